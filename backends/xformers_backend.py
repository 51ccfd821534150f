"""The `xformers` attention backend: `memory_efficient_attention_forward` with
xformers' paged causal bias, `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`.

xformers reads paged keys as one tensor `[1, pages * page_size, heads, d]` whose
page `p` is rows `p * page_size ...`. Our NHD cache interleaves each block's keys
and values, so viewed flat (`[num_blocks * 2 * block_size, heads, d]`, no copy)
block `b`'s keys are page `2b` and its values page `2b + 1`. Passing keys as the
flat view minus its last page and values as the flat view minus its first page,
both with the block table doubled, lets xformers read the cache in place.

The bias is causal with an offset per sequence (the queries are the last
`query_len` of `seq_len` positions), which is exactly our masking. GQA: the
query heads sharing a KV head form one xformers group (BMGHK, keys expanded).

Reads float KV only. xformers' one quantized-KV path (its Triton split-K kernel)
wants fp8 e4m3 or int4 codes packed into int32 and, per row, an fp16 scale and
shift packed into another int32, in its own page layout; a kvforge quantized
cache (int8/fp8 codes and float32 scales in one row of bytes per block) is
neither, so it is refused with that reason (the `triton` backend reads it).

Needs CUDA. Without it, `availability()` says so without importing xformers,
and `auto` never picks it. Validated only on a GPU (benchmarks/gpu_check.sh);
on CPU only the bias arguments are tested. Which xformers kernel serves the
paged bias depends on the GPU and the xformers build (FlashAttention-3 takes any
page size; others need large pages); when none does, xformers' own error,
listing each kernel's reasons, is raised.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.core import AttentionBackend, AttentionBatch, Availability, hookimpl



def bias_arguments(batch: AttentionBatch) -> dict[str, Any]:
    """Keyword arguments of `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens`
    for `batch` over the interleaved-page view (keys of block `b` are page `2b`)."""
    return dict(
        q_seqlen=batch.query_lens().tolist(),
        kv_seqlen=batch.seq_lens.tolist(),
        block_tables=(2 * batch.block_table).to(torch.int32),
        page_size=batch.block_size,
    )


def paged_key_value(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as xformers' paged tensors `[1, (2 * num_blocks - 1) * block_size, kv_heads, d]`,
    both views of `kv_cache` (page `2b` of the first is block `b`'s keys, of the second its values)."""
    num_blocks, _, block_size, kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(1, num_blocks * 2 * block_size, kv_heads, head_size)
    return flat[:, :-block_size], flat[:, block_size:]


@dataclass(frozen=True)
class XformersPlan:
    bias: Any  # PagedBlockDiagonalCausalWithOffsetPaddedKeysMask


class XformersAttentionBackend(AttentionBackend):
    """xformers' memory-efficient attention with its paged block-diagonal causal bias."""

    name = "xformers"
    priority = 20
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16})
    head_sizes = frozenset({64, 80, 96, 128, 256})
    quantized_kv_dtypes = frozenset()  # see the module docstring
    quantized_kv_note = ("xformers reads quantized KV only in its own packed-int32 layout with fp16 scale and "
                         "shift per row; use attention.backend = 'triton' for a kvforge quantized KV cache")

    @classmethod
    def availability(cls) -> Availability:
        if not torch.cuda.is_available():
            return Availability.no("needs CUDA (torch sees no CUDA device; xformers' paged kernels run only on GPUs)")
        if importlib.util.find_spec("xformers") is None:
            return Availability.no("xformers not installed (pip install 'kvforge[xformers]')")
        return Availability.yes()

    def __init__(self, layer, cache, device="cuda"):
        super().__init__(layer, cache, device)
        from xformers.ops import fmha  # only once a backend is built, on a CUDA machine

        self.fmha = fmha

    def plan(self, batch: AttentionBatch) -> XformersPlan:
        bias_type = self.fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
        return XformersPlan(bias_type.from_seqlens(**bias_arguments(batch), device=batch.seq_lens.device))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: XformersPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        num_tokens, num_heads, head_size = query.shape
        if num_tokens == 0:
            return out
        group = self.layer.queries_per_kv
        kv_heads = self.layer.num_kv_heads
        keys, values = paged_key_value(kv_cache)
        q = query.reshape(1, num_tokens, kv_heads, group, head_size)
        k = keys.unsqueeze(3).expand(-1, -1, -1, group, -1)
        v = values.unsqueeze(3).expand(-1, -1, -1, group, -1)
        result = self.fmha.memory_efficient_attention_forward(q, k, v, attn_bias=plan.bias,
                                                              scale=self.layer.softmax_scale)
        out.copy_(result.view(num_tokens, num_heads, head_size))
        return out


@hookimpl
def kvforge_implementations():
    return [XformersAttentionBackend]
