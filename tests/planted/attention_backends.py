"""Planted attention backends: the reference with one bug each, the bug in its docstring.

`PerSequence` (the reference, one sequence at a time) and `IgnoresLayerOptions` are
correct scaffolding for the mutants, not planted bugs themselves.
"""

from __future__ import annotations

import dataclasses

import torch

from kvforge.backends.reference import ReferenceAttentionBackend, attend, gather_sequence
from kvforge.core import cdiv, quantized_kv_views


class PerSequence(ReferenceAttentionBackend):
    """The reference, one sequence at a time, with `gather` and `attend_one` for the
    mutants below to get wrong."""

    def forward(self, query, kv_cache, plan, out=None):
        out = torch.empty_like(query) if out is None else out
        for b, (context, seq_len) in enumerate(zip(plan.context_lens, plan.seq_lens)):
            start, end = plan.query_starts[b], plan.query_starts[b + 1]
            keys, values = self.gather(kv_cache, plan.batch.block_table[b], seq_len)
            out[start:end] = self.attend_one(query[start:end], keys, values, context, plan).to(out.dtype)
        return out

    def gather(self, kv_cache, blocks, seq_len):
        return gather_sequence(kv_cache, blocks, seq_len)

    def attend_one(self, query, keys, values, context, plan):
        return attend(query, keys, values, context, self.layer)

    def without_context(self, query, keys, values, context):
        return attend(query, keys[context:], values[context:], 0, self.layer)


class IgnoresContext(PerSequence):
    """Attends only to this step's tokens, as if every sequence were a fresh prompt."""

    name = "ignores-context"

    def attend_one(self, query, keys, values, context, plan):
        return self.without_context(query, keys, values, context)


class IgnoresContextInChunks(PerSequence):
    """Decodes read their context, but a prefill chunk attends only to its own tokens
    (a varlen prefill kernel that assumes nothing is cached)."""

    name = "ignores-context-in-chunks"

    def attend_one(self, query, keys, values, context, plan):
        if len(query) > 1:
            return self.without_context(query, keys, values, context)
        return super().attend_one(query, keys, values, context, plan)


class MixedBatchAsPrefill(PerSequence):
    """Sends a whole step down the prompt path when any sequence has several new
    tokens: right for all-decode and all-prompt steps, wrong for a decode beside a prompt."""

    name = "mixed-batch-as-prefill"

    def attend_one(self, query, keys, values, context, plan):
        if plan.batch.max_query_len > 1:
            return self.without_context(query, keys, values, context)
        return super().attend_one(query, keys, values, context, plan)


class DecodeOneEarly(PerSequence):
    """Places a decode's query at position `context_len - 1`: it misses its own key."""

    name = "decode-one-early"
    shift = -1

    def attend_one(self, query, keys, values, context, plan):
        return attend(query, keys, values, context + (self.shift if len(query) == 1 else 0), self.layer)


class DecodeOneLate(DecodeOneEarly):
    """Places a decode's query at position `context_len + 1`: the causal mask cannot
    tell, only a sliding window (one key too few) shows it."""

    name = "decode-one-late"
    shift = 1


class ReadsBlockStartFromPreviousBlock(PerSequence):
    """Finds position p's block as `(p - 1) // block_size`: the first token of every
    block after the first is read from the block before it."""

    name = "reads-block-start-from-previous-block"

    def gather(self, kv_cache, blocks, seq_len):
        positions = torch.arange(seq_len)
        block_size = kv_cache.shape[2]
        pages = kv_cache[blocks.long()[(positions - 1).clamp(min=0) // block_size], :, positions % block_size]
        return pages[:, 0], pages[:, 1]  # pages: [seq_len, 2, kv_heads, head_size]


class DropsTokenOpeningABlock(PerSequence):
    """Counts a sequence's blocks as `cdiv(seq_len - 1, block_size)`: a sequence whose
    last token is the first of a block loses that token."""

    name = "drops-token-opening-a-block"

    def gather(self, kv_cache, blocks, seq_len):
        keys, values = gather_sequence(kv_cache, blocks, seq_len)
        kept = cdiv(seq_len - 1, kv_cache.shape[2]) * kv_cache.shape[2]
        return keys[:kept], values[:kept]


class WrongHeadGroups(ReferenceAttentionBackend):
    """Maps query head h to KV head h % kv_heads instead of h // queries_per_kv."""

    name = "wrong-head-groups"

    def forward(self, query, kv_cache, plan, out=None):
        group, kv_heads = self.layer.queries_per_kv, self.layer.num_kv_heads
        order = torch.tensor([(h % kv_heads) * group + h // kv_heads for h in range(self.layer.num_heads)])
        result = super().forward(query[:, order], kv_cache, plan)
        result = result[:, torch.argsort(order)]
        if out is None:
            return result
        out.copy_(result)
        return out


class HalfPrecisionInside(ReferenceAttentionBackend):
    """Quietly computes float32 layers in bfloat16."""

    name = "half-inside"

    def forward(self, query, kv_cache, plan, out=None):
        result = super().forward(query.to(torch.bfloat16), kv_cache.to(torch.bfloat16), plan).to(query.dtype)
        return result if out is None else out.copy_(result)


class SkipsLastToken(ReferenceAttentionBackend):
    """Leaves the output row of the step's last token unwritten."""

    name = "skips-last-token"

    def forward(self, query, kv_cache, plan, out=None):
        result = super().forward(query, kv_cache, plan)
        if out is None:
            return result
        out[:-1] = result[:-1]
        return out


class IgnoresLayerOptions(ReferenceAttentionBackend):
    """Declares every feature but computes as if the layer's `ignored` options were unset."""

    ignored: tuple[str, ...] = ()

    def forward(self, query, kv_cache, plan, out=None):
        saved = self.layer
        self.layer = dataclasses.replace(saved, **dict.fromkeys(self.ignored))
        try:
            return super().forward(query, kv_cache, plan, out)
        finally:
            self.layer = saved


class IgnoresWindow(IgnoresLayerOptions):
    """Declares sliding windows but attends to the whole sequence."""

    name = "ignores-window"
    ignored = ("sliding_window",)


class IgnoresSoftCap(IgnoresLayerOptions):
    """Declares the logit soft-cap but never applies it."""

    name = "ignores-soft-cap"
    ignored = ("logit_soft_cap",)


class IgnoresAlibi(IgnoresLayerOptions):
    """Declares ALiBi but adds no bias."""

    name = "ignores-alibi"
    ignored = ("alibi_slopes",)


class WritesMinusOne(ReferenceAttentionBackend):
    """Treats slot -1 as the cache's last slot (Python indexing) instead of skipping it."""

    name = "writes-minus-one"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        bs = kv_cache.shape[2]
        slots = slot_mapping % (kv_cache.shape[0] * bs)
        kv_cache[slots // bs, 0, slots % bs] = key.to(kv_cache.dtype)
        kv_cache[slots // bs, 1, slots % bs] = value.to(kv_cache.dtype)


class SpillsIntoNextSlot(ReferenceAttentionBackend):
    """Also writes each key one slot further (an off-by-one store)."""

    name = "spills"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        super().write_kv(key, value, kv_cache, slot_mapping)
        total = kv_cache.shape[0] * kv_cache.shape[2]
        spill = torch.where(slot_mapping >= 0, (slot_mapping + 1) % total, slot_mapping)
        bs = kv_cache.shape[2]
        keep = spill >= 0
        kv_cache[spill[keep] // bs, 0, spill[keep] % bs] += 1


class ReadsPadding(PerSequence):
    """Gathers every column of the block table, padding included, and relies on the
    causal mask alone (masked scores get weight 0, but 0 times NaN is NaN)."""

    name = "reads-padding"

    def gather(self, kv_cache, blocks, seq_len):
        return gather_sequence(kv_cache, blocks, len(blocks) * kv_cache.shape[2])


class AcceptsAnything(ReferenceAttentionBackend):
    """Declares no sliding window yet its constructor never refuses anything."""

    name = "accepts-anything"
    features = frozenset()
    dtypes = frozenset({torch.float32})

    def __init__(self, layer, cache, device="cpu"):
        self.layer, self.cache, self.device = layer, cache, torch.device(device)


class IgnoresScales(ReferenceAttentionBackend):
    """Reads a quantized cache's data as if every scale were 1."""

    name = "ignores-scales"

    def forward(self, query, kv_cache, plan, out=None):
        if not self.cache.quantized:
            return super().forward(query, kv_cache, plan, out)
        _, scales = quantized_kv_views(kv_cache, self.cache)
        saved = scales.clone()
        scales.fill_(1.0)
        try:
            return super().forward(query, kv_cache, plan, out)
        finally:
            scales.copy_(saved)


class StoresUnscaled(ReferenceAttentionBackend):
    """Writes quantized data but leaves the scale slots as they were."""

    name = "stores-unscaled"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        _, scales = quantized_kv_views(kv_cache, self.cache)
        saved = scales.clone()
        super().write_kv(key, value, kv_cache, slot_mapping)
        scales.copy_(saved)


class QuantizedWritesMinusOne(ReferenceAttentionBackend):
    """Quantized write that sends slot -1 to the cache's last slot (Python indexing)."""

    name = "quantized-writes-minus-one"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        last = kv_cache.shape[0] * self.cache.block_size - 1
        super().write_kv(key, value, kv_cache, torch.where(slot_mapping < 0, last, slot_mapping))


PLANTED = [
    IgnoresContext, IgnoresContextInChunks, MixedBatchAsPrefill, DecodeOneEarly, DecodeOneLate,
    ReadsBlockStartFromPreviousBlock, DropsTokenOpeningABlock, WrongHeadGroups, HalfPrecisionInside,
    SkipsLastToken, IgnoresWindow, IgnoresSoftCap, IgnoresAlibi, WritesMinusOne, SpillsIntoNextSlot,
    ReadsPadding, AcceptsAnything, IgnoresScales, StoresUnscaled, QuantizedWritesMinusOne,
]



class SplitKVByBatchSize(PerSequence):
    """Declares `batch_invariant` but splits each row's keys into pieces of 8 x (the
    step's sequence count), softmaxed apart and merged by their maxima and sums (a
    split-KV decode kernel sized to fill the machine): within tolerance of the exact
    answer, yet a row's bits change with how many sequences share its step."""

    name = "split-kv-by-batch-size"
    batch_invariant = True

    def attend_one(self, query, keys, values, context, plan):
        piece = 8 * len(plan.seq_lens)
        group = self.layer.queries_per_kv
        q = query.float().transpose(0, 1)  # [heads, q, d]
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * self.layer.softmax_scale
        positions = torch.arange(q.shape[1])[:, None] + context
        scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > positions, float("-inf"))
        total = torch.zeros_like(q)
        norm = torch.zeros(q.shape[:2] + (1,))
        top = scores.amax(dim=-1, keepdim=True)
        for start in range(0, k.shape[1], piece):
            part = scores[..., start:start + piece]
            local = part.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
            weights = torch.exp(part - local)
            factor = torch.exp(local - top)
            total += factor * (weights @ v[:, start:start + piece])
            norm += factor * weights.sum(dim=-1, keepdim=True)
        return (total / norm).transpose(0, 1)
