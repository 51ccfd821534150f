"""The `sdpa` attention backend: PyTorch's `scaled_dot_product_attention` over the paged cache.

SDPA wants contiguous keys and values, so this backend gathers them through the
block table. The gather indices and masks depend only on the batch, so `plan`
builds them once per step and every layer reuses them:

* Decodes (one new token) go through one batched SDPA call per group of similar
  lengths (usually one group for the whole step), padded to the group's longest
  sequence with a boolean key mask; a decode reading under half of its group's
  longest span starts a new group, so padding at most doubles a group's work. The
  query heads that share a KV head are packed into SDPA's query-length dimension,
  so keys and values are never repeated per query head.
* With a sliding window only the keys inside the window are gathered.
* Every other sequence (a prompt, a chunk over context, a token plus drafts) gets
  its own call: `is_causal` when it has no context, otherwise an explicit
  bottom-right causal mask.

Gathers land in a scratch buffer the instance keeps (fresh multi-megabyte tensors
per layer cost page faults), so one instance must not run two forwards at once.
Only slots inside a sequence are gathered (padding points at the sequence's own
first slot and is masked), so unreferenced blocks and stale slots are never read.
A quantized cache (int8, fp8 e4m3 or e5m2 data with one float32 scale per token
and KV head) is read through the same rows: just their data and scales are
fetched and dequantized (`data * scale`) into the compute dtype, never the whole
cache. Logit soft-cap is not expressible through SDPA and is refused. ALiBi goes
in as a float mask, computed in float32 for half-precision layers, since a bias
of `slope * distance` loses whole units in bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.core import (
    ALIBI,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    SCALE_DTYPE,
    KVCacheSpec,
    hookimpl,
)


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with more than one new token: its query rows and cache rows."""

    start: int
    end: int
    rows: torch.Tensor  # [2, seq_len] rows of the flat cache holding its keys, then its values, in order
    mask: torch.Tensor | None  # [q, seq_len] bool or float, None when plain causal


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar length, served by one batched SDPA call."""

    tokens: torch.Tensor  # [n] query rows
    rows: torch.Tensor  # [2, n, L] flat-cache rows of their keys, then of their values
    mask: torch.Tensor  # [n, 1 or kv_heads, 1 or group, L], bool or float (ALiBi)


@dataclass(frozen=True)
class SdpaPlan:
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSeq, ...]


class SdpaAttentionBackend(AttentionBackend):
    """Paged attention through `torch.nn.functional.scaled_dot_product_attention`."""

    name = "sdpa"
    priority = 10
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
    features = frozenset({SLIDING_WINDOW, ALIBI})
    quantized_kv_dtypes = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})

    def __init__(self, layer: AttentionLayerSpec, cache: KVCacheSpec, device: str | torch.device = "cpu"):
        super().__init__(layer, cache, device)
        self.scratch: torch.Tensor | None = None  # gather buffer reused by every forward (not thread-safe)

    def _compute_dtype(self) -> torch.dtype:
        if self.layer.alibi_slopes is not None:
            return torch.promote_types(self.cache.dtype, torch.float32)
        return self.cache.dtype

    def _bias(self, key_pos: torch.Tensor, query_pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Float mask `[..., heads, q, k]` carrying ALiBi and -inf where not allowed."""
        slopes = torch.tensor(self.layer.alibi_slopes, dtype=torch.float32, device=key_pos.device)
        distance = (key_pos.unsqueeze(-2) - query_pos.unsqueeze(-1)).to(torch.float32)  # [..., q, k]
        bias = slopes.view(-1, 1, 1) * distance.unsqueeze(-3)
        return bias.masked_fill(~allowed.unsqueeze(-3), float("-inf")).to(self._compute_dtype())

    def plan(self, batch: AttentionBatch) -> SdpaPlan:
        starts = batch.query_start_loc.tolist()
        contexts, seq_lens = batch.context_lens.tolist(), batch.seq_lens.tolist()
        query_lens = [starts[b + 1] - starts[b] for b in range(len(seq_lens))]
        window = self.layer.sliding_window or max(seq_lens, default=0)
        span = {b: min(seq_lens[b], window) for b, q in enumerate(query_lens) if q == 1}  # keys each decode reads
        # Longest first; a new group starts when a decode reads under half the group's
        # longest span, so padding never more than doubles the work of a group.
        groups: list[list[int]] = []
        for b in sorted(span, key=lambda b: -span[b]):
            if not groups or 2 * span[b] < span[groups[-1][0]]:
                groups.append([])
            groups[-1].append(b)
        decodes = tuple(self._decode_group(batch, group, [span[b] for b in group]) for group in groups)
        prefills = tuple(self._prefill(batch, b, starts[b], starts[b + 1], contexts[b], seq_lens[b])
                         for b, q in enumerate(query_lens) if q > 1)
        return SdpaPlan(decodes, prefills)

    def _decode_group(self, batch: AttentionBatch, seqs: list[int], spans: list[int]) -> DecodeGroup:
        device = batch.block_table.device
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        spans_t = torch.tensor(spans, dtype=torch.long, device=device).unsqueeze(1)
        lens = batch.seq_lens.to(device).index_select(0, index).long().unsqueeze(1)
        offsets = torch.arange(spans[0], device=device)
        allowed = offsets < spans_t  # [n, L]
        key_pos = torch.where(allowed, lens - spans_t + offsets, lens - spans_t)  # padding repeats a real key
        rows = self._rows(batch, batch.block_table.index_select(0, index), key_pos)
        if self.layer.alibi_slopes is not None:
            bias = self._bias(key_pos, lens - 1, allowed.unsqueeze(1))  # [n, heads, 1, L]
            mask = bias.view(len(seqs), self.layer.num_kv_heads, self.layer.queries_per_kv, spans[0])
        else:
            mask = allowed.view(len(seqs), 1, 1, spans[0])
        tokens = batch.query_start_loc.to(device).index_select(0, index).long()
        return DecodeGroup(tokens, rows, mask)

    def _prefill(self, batch: AttentionBatch, b: int, start: int, end: int, context: int, seq_len: int) -> PrefillSeq:
        device, window = batch.block_table.device, self.layer.sliding_window
        first_key = max(0, context + 1 - window) if window is not None else 0  # the first token's window
        key_pos = torch.arange(first_key, seq_len, device=device)
        query_pos = torch.arange(context, seq_len, device=device)
        mask = None
        if context or window is not None or self.layer.alibi_slopes is not None:
            ok = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            if window is not None:
                ok &= key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window
            mask = ok if self.layer.alibi_slopes is None else self._bias(key_pos, query_pos, ok)
        return PrefillSeq(start, end, self._rows(batch, batch.block_table[b], key_pos), mask)

    @staticmethod
    def _rows(batch: AttentionBatch, table: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """`[2, *key_pos.shape]` rows of the cache viewed as `[num_blocks * 2 * block_size,
        kv_heads, head_size]`: first the keys at `key_pos`, then their values."""
        block_size = batch.block_size
        blocks = table.gather(-1, key_pos // block_size).long()
        keys = blocks * (2 * block_size) + key_pos % block_size
        return torch.stack([keys, keys + block_size])

    def _gather(self, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`flat[rows]` into a scratch buffer kept across calls: a fresh multi-megabyte
        tensor per layer pays page faults that cost more than the copy itself
        (docs/attention.md)."""
        need = rows.numel() * flat.shape[1] * flat.shape[2]
        scratch = self.scratch
        if scratch is None or scratch.numel() < need or scratch.dtype != flat.dtype or scratch.device != flat.device:
            scratch = self.scratch = torch.empty(need, dtype=flat.dtype, device=flat.device)
        gathered = scratch[:need].view(rows.numel(), *flat.shape[1:])
        return torch.index_select(flat, 0, rows.flatten(), out=gathered).view(*rows.shape, *flat.shape[1:])

    def _dequantize(self, kv_cache: torch.Tensor, rows: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        """`[*rows.shape, kv_heads, head_size]` dequantized keys/values at the flat rows
        `rows` (numbered as in `_rows`) of a quantized cache: only those rows' data and
        scales are read, then multiplied (`data * scale`) in float32."""
        spec, kv_heads, head_size = self.cache, self.layer.num_kv_heads, self.layer.head_size
        per_block, row_bytes = 2 * spec.block_size, kv_heads * head_size * spec.storage_dtype.itemsize
        blocks, within = rows.flatten() // per_block, rows.flatten() % per_block
        block_start = blocks * spec.layer_block_bytes()  # in bytes; the layout is `quantized_kv_views`'
        # A view in which every byte offset starts a row, so one index_select fetches rows
        # wherever they sit in a block's bytes: one flat gather instead of indexing the 5-D view.
        data = _rows_at(kv_cache.view(-1), block_start + within * row_bytes, row_bytes)
        scale_start = (block_start + spec.scale_offset()) // SCALE_DTYPE.itemsize + within * kv_heads
        scales = _rows_at(kv_cache.view(-1).view(SCALE_DTYPE), scale_start, kv_heads)
        decode = _byte_table(spec.storage_dtype, kv_cache.device)
        if decode is not None:  # a 256-entry table: faster on CPU than torch's fp8 -> float32 cast
            values = decode.index_select(0, data.flatten().int()).view(-1, kv_heads, head_size)
        else:
            values = data.view(spec.storage_dtype).to(torch.float32).view(-1, kv_heads, head_size)
        values.mul_(scales.unsqueeze(-1))
        return values.view(*rows.shape, kv_heads, head_size).to(compute)

    def _keys_values(self, kv_cache: torch.Tensor, rows: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        """The cache at `rows` (`[2, ...]`: keys, then values) in `compute`, `[*rows.shape, kv_heads, head_size]`."""
        if self.cache.quantized:
            return self._dequantize(kv_cache, rows, compute)
        return self._gather(kv_cache.view(-1, self.layer.num_kv_heads, self.layer.head_size), rows).to(compute)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        kv_heads, head_size = self.layer.num_kv_heads, self.layer.head_size
        heads, group, scale = self.layer.num_heads, self.layer.queries_per_kv, self.layer.softmax_scale
        compute = self._compute_dtype()
        for group_plan in plan.decodes:
            n = group_plan.tokens.numel()
            keys, values = self._keys_values(kv_cache, group_plan.rows, compute).transpose(2, 3)  # [n, kv_heads, L, d]
            q = query.index_select(0, group_plan.tokens).view(n, kv_heads, group, head_size)
            result = F.scaled_dot_product_attention(q.to(compute), keys, values, attn_mask=group_plan.mask,
                                                    scale=scale)
            out.index_copy_(0, group_plan.tokens, result.reshape(n, heads, head_size).to(out.dtype))
        for seq in plan.prefills:
            # [1, kv_heads, L, d] each
            keys, values = self._keys_values(kv_cache, seq.rows, compute).transpose(1, 2).unsqueeze(1)
            q = query[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
            result = F.scaled_dot_product_attention(
                q.to(compute), keys, values, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale,
                enable_gqa=group > 1)
            out[seq.start:seq.end] = result[0].transpose(0, 1).to(out.dtype)
        return out


def _rows_at(flat: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """`[len(starts), width]`: the `width` elements of the 1-D `flat` from each start."""
    windows = flat.as_strided((flat.numel() - width + 1, width), (1, 1))
    return torch.index_select(windows, 0, starts)


@functools.lru_cache(maxsize=None)
def _byte_table(storage: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Every value of a 1-byte floating storage dtype as float32, indexed by its bits;
    None for other dtypes (int8 converts fast enough directly)."""
    if not storage.is_floating_point or storage.itemsize != 1:
        return None
    return torch.arange(256, dtype=torch.uint8, device=device).view(storage).to(torch.float32)


@hookimpl
def kvforge_implementations():
    return [SdpaAttentionBackend]
