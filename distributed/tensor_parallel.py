"""Megatron-style tensor parallelism of a loaded model: each rank keeps its slice.

Per decoder layer (Llama family: Llama, Mistral, Qwen2, Qwen3; GPT-2 alike, with
`c_attn`, `c_proj`, `c_fc` and `c_proj` in those roles and no gate):
* the fused `qkv_proj` is column-parallel: rank r keeps the rows of its query
  heads and of their KV heads, still one fused GEMM (`[q_r; k_r; v_r]`);
* `o_proj` is row-parallel (`RowParallelLinear`): rank r keeps the input columns
  of its heads; the partial sums meet in one all-reduce, then the bias and the
  residual are added once;
* `gate_proj` and `up_proj` are column-parallel (rank r keeps 1/size of the
  intermediate features; the activation and the gate x up product stay fused
  into those GEMMs, see `packed_linear`), `down_proj` row-parallel: one
  all-reduce after the MLP.

So a layer costs two all-reduces of `[tokens, hidden]`. Attention heads split
evenly; KV heads split too when there are at least as many as ranks, and are
replicated otherwise (rank r keeps KV head `r // (size // num_kv_heads)`, the
one its query heads read). Each rank's `AttentionLayerSpec` says how many heads
it holds, so every attention backend runs unchanged on fewer heads, and the KV
cache each rank allocates (`kv_cache_spec`) holds only its KV heads.

The token embedding and the LM head are split by vocabulary rows
(`vocab_parallel`), or replicated on every rank with `vocab_parallel=False`
(`parallel.vocab_parallel = false`); see docs/distributed.md for the memory either way.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvforge.core import AttentionLayerSpec, ConfigError
from kvforge.models.gpt2 import GPT2LMHeadModel
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.packed_linear import linear_weight

from .group import RankGroup
from .vocab_parallel import split_vocab


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_r W_r^T) + b`: this rank's input columns of a linear layer.

    `inner` is a bias-free linear layer over this rank's slice (it may later be
    packed or quantized like any other); the bias is added once, after the sum."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: RankGroup):
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.inner(x).contiguous())
        return out if self.bias is None else out.add_(self.bias)


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """Which heads of a layer one rank holds: query heads `[q_start, q_stop)` and
    KV heads `[kv_start, kv_stop)`."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    def spec(self, full: AttentionLayerSpec) -> AttentionLayerSpec:
        """`full` restricted to these heads (ALiBi slopes sliced with the query heads)."""
        slopes = full.alibi_slopes[self.q_start:self.q_stop] if full.alibi_slopes is not None else None
        return dataclasses.replace(full, num_heads=self.q_stop - self.q_start,
                                   num_kv_heads=self.kv_stop - self.kv_start, alibi_slopes=slopes)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Rank `rank`'s heads out of `size`; a ConfigError naming the sizes that work
    when the heads do not divide."""
    if num_heads % size:
        raise ConfigError(f"parallel.tensor_parallel_size = {size} does not divide the model's {num_heads} attention "
                          f"heads; choose one of: {', '.join(map(str, divisors(num_heads)))}")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ConfigError(f"parallel.tensor_parallel_size = {size} does not divide the model's {num_kv_heads} KV "
                          f"heads; choose one of: {', '.join(map(str, divisors(num_kv_heads)))}, or a multiple of "
                          f"{num_kv_heads} that divides {num_heads}")
    if num_kv_heads < size and size % num_kv_heads:
        raise ConfigError(f"parallel.tensor_parallel_size = {size} is above the model's {num_kv_heads} KV heads but "
                          f"not a multiple of it, so KV heads cannot be replicated evenly; choose a size that divides "
                          f"{num_kv_heads} or a multiple of {num_kv_heads} that divides {num_heads}")
    per_rank = num_heads // size
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        kv_start = rank * kv_per_rank
    else:
        kv_per_rank, kv_start = 1, rank // (size // num_kv_heads)
    return HeadShard(rank * per_rank, (rank + 1) * per_rank, kv_start, kv_start + kv_per_rank)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def keep_outputs(layer: nn.Module, spans: list[tuple[int, int]]) -> nn.Linear:
    """An `nn.Linear` computing only the output features in `spans` of `layer` (an
    `nn.Linear` or GPT-2's `Conv1D`), in that order: a column-parallel shard. The
    slices are copies, so the full weight's memory goes with the old layer."""
    weight, bias = linear_weight(layer)
    kept = torch.cat([weight[a:b] for a, b in spans]).contiguous()
    return _linear(kept, None if bias is None else torch.cat([bias[a:b] for a, b in spans]))


def row_parallel(layer: nn.Module, start: int, stop: int, group: RankGroup) -> RowParallelLinear:
    """Input features `[start, stop)` of `layer`, summed over the ranks."""
    weight, bias = linear_weight(layer)
    return RowParallelLinear(_linear(weight[:, start:stop].clone(memory_format=torch.contiguous_format), None), bias,
                             group)


def fused_qkv_spans(full: AttentionLayerSpec, shard: HeadShard) -> list[tuple[int, int]]:
    """The output features of a fused `[q; k; v]` projection that `shard`'s heads need."""
    head = full.head_size
    k_base = full.num_heads * head
    v_base = k_base + full.num_kv_heads * head
    return [(shard.q_start * head, shard.q_stop * head),
            *((base + shard.kv_start * head, base + shard.kv_stop * head) for base in (k_base, v_base))]


def _mlp_part(inner: int, size: int) -> int:
    if inner % size:
        raise ConfigError(f"parallel.tensor_parallel_size = {size} does not divide the MLP's {inner} intermediate "
                          f"features; choose a size that divides it and the heads")
    return inner // size


@torch.no_grad()
def shard_llama(model: LlamaForCausalLM, group: RankGroup) -> None:
    """Keep this rank's slice of every decoder layer of a loaded Llama-family model
    (q, k and v already fused by `finish_loading`), in place."""
    rank, size = group.rank, group.size
    shards = [head_shard(full.num_heads, full.num_kv_heads, rank, size) for full in model.layer_specs]
    part = _mlp_part(int(model.config["intermediate_size"]), size)
    mlp_span = (rank * part, (rank + 1) * part)
    for layer, full, shard in zip(model.model.layers, model.layer_specs, shards):
        attn, head = layer.self_attn, full.head_size
        attn.qkv_proj = keep_outputs(attn.qkv_proj, fused_qkv_spans(full, shard))
        attn.o_proj = row_parallel(attn.o_proj, shard.q_start * head, shard.q_stop * head, group)
        attn.attn.spec = shard.spec(full)
        mlp = layer.mlp
        mlp.gate_proj = keep_outputs(mlp.gate_proj, [mlp_span])
        mlp.up_proj = keep_outputs(mlp.up_proj, [mlp_span])
        mlp.down_proj = row_parallel(mlp.down_proj, *mlp_span, group)
    model.layer_specs = [shard.spec(full) for full, shard in zip(model.layer_specs, shards)]


@torch.no_grad()
def shard_gpt2(model: GPT2LMHeadModel, group: RankGroup) -> None:
    """Keep this rank's slice of every block of a loaded GPT-2 (fused `c_attn`, every
    head its own KV head), in place; the layers become `nn.Linear` shards."""
    rank, size = group.rank, group.size
    shards = [head_shard(full.num_heads, full.num_kv_heads, rank, size) for full in model.layer_specs]
    part = _mlp_part(model.transformer.h[0].mlp.c_fc.weight.shape[1], size)  # Conv1D: [in, out]
    mlp_span = (rank * part, (rank + 1) * part)
    for block, full, shard in zip(model.transformer.h, model.layer_specs, shards):
        attn, head = block.attn, full.head_size
        attn.c_attn = keep_outputs(attn.c_attn, fused_qkv_spans(full, shard))
        attn.c_proj = row_parallel(attn.c_proj, shard.q_start * head, shard.q_stop * head, group)
        attn.attn.spec = shard.spec(full)
        block.mlp.c_fc = keep_outputs(block.mlp.c_fc, [mlp_span])
        block.mlp.c_proj = row_parallel(block.mlp.c_proj, *mlp_span, group)
    model.layer_specs = [shard.spec(full) for full, shard in zip(model.layer_specs, shards)]


def shard_model(model: nn.Module, group: RankGroup, *, vocab_parallel: bool = True) -> None:
    """Keep this rank's slice of a loaded float model, in place: every layer's heads and
    MLP features, and with `vocab_parallel` the embedding's and LM head's vocabulary
    rows; refuses, naming the supported architectures, a model it does not know."""
    if group.size == 1:
        return
    if isinstance(model, LlamaForCausalLM):
        shard_llama(model, group)
    elif isinstance(model, GPT2LMHeadModel):
        shard_gpt2(model, group)
    else:
        raise ConfigError(f"tensor parallelism supports the Llama family (Llama, Mistral, Qwen2, Qwen3) and GPT-2, "
                          f"not {type(model).__name__}; set parallel.tensor_parallel_size = 1 for this model")
    if vocab_parallel:
        split_vocab(model, group)
