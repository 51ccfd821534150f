"""Megatron-style tensor parallelism of a loaded model: each rank keeps its slice.

Per decoder layer (Llama family: Llama, Mistral, Qwen2, Qwen3; GPT-2 alike, with
`c_attn`, `c_proj`, `c_fc` and `c_proj` in those roles and no gate):
* the fused `qkv_proj` is column-parallel: rank r keeps the rows of its query
  heads and of their KV heads, still one fused GEMM (`[q_r; k_r; v_r]`; loading
  reads those rows of q, k and v, which `finish_loading` fuses);
* `o_proj` is row-parallel (`RowParallelLinear`): rank r keeps the input columns
  of its heads; the partial sums meet in one all-reduce, then the bias and the
  residual are added once;
* `gate_proj` and `up_proj` are column-parallel (rank r keeps 1/size of the
  intermediate features; the activation and the gate x up product stay fused
  into those GEMMs, see `packed_linear`), `down_proj` row-parallel: one
  all-reduce after the MLP.

Each split is described once, as the slice of every checkpoint tensor a rank
keeps (`tensor_parallel_slices`, read from the file by the loader, see
`kvforge.models.weight_slices`), then applied to the layers (`apply_tensor_parallel`).

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
from kvforge.models.weight_slices import WeightSlice, rows, take_slices

from .group import RankGroup
from .vocab_parallel import apply_vocab, vocab_slices


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


def as_linear(layer: nn.Module) -> nn.Linear:
    """A column-parallel shard whose weight already holds its output rows (an `nn.Linear`,
    or GPT-2's `Conv1D`, transposed once) as an `nn.Linear` of the right sizes."""
    weight, bias = linear_weight(layer)
    return _linear(weight.contiguous(), bias)


def as_row_parallel(layer: nn.Module, group: RankGroup) -> RowParallelLinear:
    """A row-parallel shard whose weight already holds its input columns (its bias whole),
    summed over the ranks."""
    weight, bias = linear_weight(layer)
    return RowParallelLinear(_linear(weight.contiguous(), None), bias, group)


def fused_qkv_spans(full: AttentionLayerSpec, shard: HeadShard) -> list[tuple[int, int]]:
    """The output features of a fused `[q; k; v]` projection that `shard`'s heads need."""
    head = full.head_size
    k_base = full.num_heads * head
    v_base = k_base + full.num_kv_heads * head
    return [(shard.q_start * head, shard.q_stop * head),
            *((base + shard.kv_start * head, base + shard.kv_stop * head) for base in (k_base, v_base))]


def _mlp_span(inner: int, rank: int, size: int) -> tuple[int, int]:
    if inner % size:
        raise ConfigError(f"parallel.tensor_parallel_size = {size} does not divide the MLP's {inner} intermediate "
                          f"features; choose a size that divides it and the heads")
    part = inner // size
    return rank * part, (rank + 1) * part


def _with_bias(module: nn.Module, prefix: str, weight: WeightSlice, bias: WeightSlice | None = None):
    """`prefix.weight`'s slice, and `prefix.bias`'s when the layer has one (`bias`, or the
    weight's output rows)."""
    yield f"{prefix}.weight", weight
    if getattr(module, "bias", None) is not None and bias is not None:
        yield f"{prefix}.bias", bias


def llama_slices(model: LlamaForCausalLM, rank: int, size: int) -> dict[str, WeightSlice]:
    """Rank `rank`'s slices of every decoder layer of a Llama-family model: q, k and v
    separately as the checkpoint stores them, or fused once `finish_loading` ran."""
    mlp = _mlp_span(int(model.config["intermediate_size"]), rank, size)
    slices: dict[str, WeightSlice] = {}
    for i, (layer, full) in enumerate(zip(model.model.layers, model.layer_specs)):
        shard, head, attn = head_shard(full.num_heads, full.num_kv_heads, rank, size), full.head_size, layer.self_attn
        p = f"model.layers.{i}."
        q, kv = (shard.q_start * head, shard.q_stop * head), (shard.kv_start * head, shard.kv_stop * head)
        projections = ({"q_proj": rows(*q), "k_proj": rows(*kv), "v_proj": rows(*kv)} if attn.qkv_proj is None
                       else {"qkv_proj": WeightSlice(0, tuple(fused_qkv_spans(full, shard)))})
        for name, part in projections.items():
            slices.update(_with_bias(getattr(attn, name), f"{p}self_attn.{name}", part, part))
        slices[f"{p}self_attn.o_proj.weight"] = WeightSlice(1, (q,))
        for name in ("gate_proj", "up_proj"):
            slices.update(_with_bias(getattr(layer.mlp, name), f"{p}mlp.{name}", rows(*mlp), rows(*mlp)))
        slices[f"{p}mlp.down_proj.weight"] = WeightSlice(1, (mlp,))
    return slices


def gpt2_slices(model: GPT2LMHeadModel, rank: int, size: int) -> dict[str, WeightSlice]:
    """Rank `rank`'s slices of every block of GPT-2, whose `Conv1D` weights are stored
    `[in, out]`: output features are dimension 1, input features dimension 0."""
    mlp = _mlp_span(model.transformer.h[0].mlp.c_fc.weight.shape[1], rank, size)
    slices: dict[str, WeightSlice] = {}
    for i, full in enumerate(model.layer_specs):
        shard, head = head_shard(full.num_heads, full.num_kv_heads, rank, size), full.head_size
        p = f"transformer.h.{i}."
        qkv = tuple(fused_qkv_spans(full, shard))
        slices.update({f"{p}attn.c_attn.weight": WeightSlice(1, qkv), f"{p}attn.c_attn.bias": WeightSlice(0, qkv),
                       f"{p}attn.c_proj.weight": rows(shard.q_start * head, shard.q_stop * head),
                       f"{p}mlp.c_fc.weight": WeightSlice(1, (mlp,)), f"{p}mlp.c_fc.bias": rows(*mlp),
                       f"{p}mlp.c_proj.weight": rows(*mlp)})
    return slices


def tensor_parallel_slices(model: nn.Module, rank: int, size: int, *, vocab_parallel: bool) -> dict[str, WeightSlice]:
    """Which slice of each weight rank `rank` of `size` keeps (`weight_slices`); refuses,
    naming the supported architectures, a model tensor parallelism does not know."""
    if size == 1:
        return {}
    if isinstance(model, LlamaForCausalLM):
        slices = llama_slices(model, rank, size)
    elif isinstance(model, GPT2LMHeadModel):
        slices = gpt2_slices(model, rank, size)
    else:
        raise ConfigError(f"tensor parallelism supports the Llama family (Llama, Mistral, Qwen2, Qwen3) and GPT-2, "
                          f"not {type(model).__name__}; set parallel.tensor_parallel_size = 1 for this model")
    return {**slices, **(vocab_slices(model, rank, size) if vocab_parallel else {})}


def lora_slices(model: nn.Module, slices: dict[str, WeightSlice]) -> dict:
    """How LoRA adapters are cut on a rank whose weights are cut by `slices`: per
    checkpoint layer, the slice of A `[r, in]` (a row-parallel layer's input columns)
    and of B `[out, r]` (a column-parallel layer's output rows), the spans of the
    layer's weight; None for a layer of another pipeline stage. GPT-2's Conv1D
    weights are stored `[in, out]`, so their dimensions swap."""
    out_dim = 1 if isinstance(model, GPT2LMHeadModel) else 0
    cuts: dict = {}
    for name, part in slices.items():
        layer, _, kind = name.rpartition(".")
        if kind != "weight":
            continue
        if part.skipped:
            cuts[layer] = None
        elif part.dim == out_dim:
            cuts[layer] = (None, WeightSlice(0, part.spans))
        else:
            cuts[layer] = (WeightSlice(1, part.spans), None)
    return cuts


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, group: RankGroup, *, vocab_parallel: bool) -> None:
    """Turn a model whose weights hold this rank's slices (`tensor_parallel_slices`, read
    so or taken) into its shard, in place: column-parallel layers become `nn.Linear`s of
    their rows, row-parallel ones `RowParallelLinear`s, each attention its heads' spec,
    and with `vocab_parallel` the embedding and head their vocabulary rows."""
    if group.size == 1:
        return
    shards = [head_shard(full.num_heads, full.num_kv_heads, group.rank, group.size) for full in model.layer_specs]
    if isinstance(model, LlamaForCausalLM):
        for layer, full, shard in zip(model.model.layers, model.layer_specs, shards):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = as_linear(attn.qkv_proj), as_row_parallel(attn.o_proj, group)
            attn.attn.spec = shard.spec(full)
            mlp.gate_proj, mlp.up_proj = as_linear(mlp.gate_proj), as_linear(mlp.up_proj)
            mlp.down_proj = as_row_parallel(mlp.down_proj, group)
    else:
        for block, full, shard in zip(model.transformer.h, model.layer_specs, shards):
            attn, mlp = block.attn, block.mlp
            attn.c_attn, attn.c_proj = as_linear(attn.c_attn), as_row_parallel(attn.c_proj, group)
            attn.attn.spec = shard.spec(full)
            mlp.c_fc, mlp.c_proj = as_linear(mlp.c_fc), as_row_parallel(mlp.c_proj, group)
    model.layer_specs = [shard.spec(full) for full, shard in zip(model.layer_specs, shards)]
    if vocab_parallel:
        apply_vocab(model, group)


def shard_model(model: nn.Module, group: RankGroup, *, vocab_parallel: bool = True) -> None:
    """Keep this rank's slice of a loaded float model, in place: every layer's heads and
    MLP features, and with `vocab_parallel` the embedding's and LM head's vocabulary
    rows. Loading reads only those slices instead (`shard_loading`); this is the same
    split of a model already in memory."""
    take_slices(model, tensor_parallel_slices(model, group.rank, group.size, vocab_parallel=vocab_parallel))
    apply_tensor_parallel(model, group, vocab_parallel=vocab_parallel)
