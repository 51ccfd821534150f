"""The `reference` attention backend: plain PyTorch, exact, slow on purpose.

It is the oracle of the conformance suite, so it favours being obviously right
over being fast: each sequence's keys and values are gathered through the block
table into a contiguous tensor, every score is materialised, and the masks are
spelled out exactly as `kvforge.core.attention`'s module docstring defines them.
Given float64 inputs it computes in float64; float16 and bfloat16 are computed
in float32 and rounded once at the end. A quantized cache (int8, fp8 e4m3 or
e5m2, any per_token quantizer) is read by dequantizing just the blocks each
sequence references (`dequantize_kv_blocks`), in that same compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.core import (
    ALIBI,
    LOGIT_SOFT_CAP,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    cdiv,
    dequantize_kv_blocks,
    hookimpl,
)


@dataclass(frozen=True)
class ReferencePlan:
    """The batch plus its per-sequence lengths as host integers, read once per step."""

    batch: AttentionBatch
    query_starts: tuple[int, ...]
    context_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


class ReferenceAttentionBackend(AttentionBackend):
    """Exact attention by gathering each sequence's cache; the conformance oracle."""

    name = "reference"
    priority = -100  # the last choice of `auto`: every other backend is faster
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
    features = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI})
    quantized_kv_dtypes = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})

    def plan(self, batch: AttentionBatch) -> ReferencePlan:
        return ReferencePlan(
            batch=batch,
            query_starts=tuple(batch.query_start_loc.tolist()),
            context_lens=tuple(batch.context_lens.tolist()),
            seq_lens=tuple(batch.seq_lens.tolist()),
        )

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: ReferencePlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        block_table = plan.batch.block_table
        for b, (context_len, seq_len) in enumerate(zip(plan.context_lens, plan.seq_lens)):
            start, end = plan.query_starts[b], plan.query_starts[b + 1]
            if end == start:
                continue
            keys, values = gather_sequence(kv_cache, block_table[b], seq_len, self.cache)
            out[start:end] = attend(query[start:end], keys, values, context_len, self.layer).to(out.dtype)
        return out


def gather_sequence(kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                    cache: KVCacheSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[seq_len, num_kv_heads, head_size]` of one sequence, in order;
    dequantized (to float32, or float64 for a float64 layer) when `cache` is quantized."""
    quantized = cache is not None and cache.quantized
    block_size = cache.block_size if quantized else kv_cache.shape[2]
    used = blocks[: cdiv(seq_len, block_size)].long()
    if quantized:
        pages = dequantize_kv_blocks(kv_cache, cache, used, torch.promote_types(cache.dtype, torch.float32))
    else:
        pages = kv_cache[used]  # [n, 2, block_size, kv_heads, head_size]
    keys = pages[:, 0].reshape(-1, *pages.shape[3:])[:seq_len]
    values = pages[:, 1].reshape(-1, *pages.shape[3:])[:seq_len]
    return keys, values


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
           layer: AttentionLayerSpec) -> torch.Tensor:
    """Attention of one sequence's new tokens `[q, heads, d]` over its keys `[k, kv_heads, d]`.

    Query token `i` sits at position `context_len + i`. Computes in float64 for
    float64 inputs and in float32 otherwise; returns that compute dtype.
    """
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.to(compute).transpose(0, 1)  # [heads, q, d]
    group = layer.queries_per_kv
    k = keys.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, k, d]
    v = values.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * layer.softmax_scale  # [heads, q, k]
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        scores = cap * torch.tanh(scores / cap)
    query_pos = torch.arange(q.shape[1], device=q.device) + context_len
    key_pos = torch.arange(k.shape[1], device=q.device)
    distance = key_pos[None, :] - query_pos[:, None]  # [q, k]: key minus query position
    if layer.alibi_slopes is not None:
        slopes = torch.tensor(layer.alibi_slopes, dtype=compute, device=q.device)
        scores = scores + slopes[:, None, None] * distance.to(compute)
    allowed = distance <= 0
    if layer.sliding_window is not None:
        allowed &= distance > -layer.sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(0, 1)  # [q, heads, d]


@hookimpl
def kvforge_implementations():
    return [ReferenceAttentionBackend]
