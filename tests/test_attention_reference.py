"""The `reference` attention backend, checked against a from-scratch per-token oracle
(it is itself the conformance oracle, so it must not be judged by itself)."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.backends.reference import ReferenceAttentionBackend
from kvforge.core import (
    ATTENTION_BACKEND,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
    cdiv,
)


def step(lengths, block_size, kv_heads, head_size, seed=0, dtype=torch.float64):
    """A batch with blocks handed out back to front, the new tokens already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in lengths]
    per_seq = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    order = list(range(num_blocks - 1, -1, -1))
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_size, generator=gen, dtype=dtype)
    slots = torch.cat([table[b, torch.arange(c, c + q) // block_size].long() * block_size
                       + torch.arange(c, c + q) % block_size for b, (c, q) in enumerate(lengths)])
    starts = torch.tensor([0] + [q for _, q in lengths]).cumsum(0).to(torch.int32)
    batch = AttentionBatch(starts, torch.tensor(seq_lens, dtype=torch.int32),
                           torch.tensor([c for c, _ in lengths], dtype=torch.int32), table, slots, block_size,
                           max(q for _, q in lengths), max(seq_lens))
    return batch, cache


def per_token_oracle(query, cache, batch, layer):
    """Attention written out token by token, head by head, straight from the core docstring."""
    out = torch.zeros_like(query, dtype=torch.float64)
    bs = batch.block_size
    for b in range(batch.num_seqs):
        start, end = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        context = int(batch.context_lens[b])
        for i in range(end - start):
            p = context + i
            for h in range(layer.num_heads):
                kv = h // layer.queries_per_kv
                scores, values = [], []
                for j in range(p + 1):
                    if layer.sliding_window is not None and j < p - layer.sliding_window + 1:
                        continue
                    slot_block, offset = int(batch.block_table[b, j // bs]), j % bs
                    key = cache[slot_block, 0, offset, kv].double()
                    s = float(query[start + i, h].double() @ key) * layer.softmax_scale
                    if layer.logit_soft_cap is not None:
                        s = layer.logit_soft_cap * math.tanh(s / layer.logit_soft_cap)
                    if layer.alibi_slopes is not None:
                        s += layer.alibi_slopes[h] * (j - p)
                    scores.append(s)
                    values.append(cache[slot_block, 1, offset, kv].double())
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[start + i, h] = (weights[:, None] * torch.stack(values)).sum(0)
    return out


LAYERS = {
    "plain": AttentionLayerSpec(4, 2, 8),
    "mha": AttentionLayerSpec(2, 2, 8),
    "window": AttentionLayerSpec(4, 1, 8, sliding_window=3),
    "soft_cap": AttentionLayerSpec(4, 2, 8, logit_soft_cap=0.7),
    "alibi": AttentionLayerSpec(4, 2, 8, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "everything": AttentionLayerSpec(4, 1, 8, scale=0.3, sliding_window=2, logit_soft_cap=1.1,
                                     alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_matches_the_per_token_definition_in_float64(name):
    layer = LAYERS[name]
    lengths = [(0, 5), (3, 1), (6, 4), (9, 1)]  # prompt, decode, chunk over context, decode
    batch, cache = step(lengths, 4, layer.num_kv_heads, layer.head_size, seed=len(name))
    query = torch.randn(batch.num_tokens, layer.num_heads, layer.head_size, dtype=torch.float64)
    backend = ReferenceAttentionBackend(layer, KVCacheSpec(4, layer.num_kv_heads, layer.head_size, torch.float64))
    out = backend.forward(query, cache, backend.plan(batch))
    torch.testing.assert_close(out, per_token_oracle(query, cache, batch, layer), rtol=1e-12, atol=1e-12)


def test_half_precision_is_computed_in_float32_and_rounded_once():
    layer = LAYERS["plain"]
    batch, cache = step([(2, 3), (7, 1)], 2, 2, 8, dtype=torch.float64)
    query = torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64).to(torch.bfloat16)
    cache = cache.to(torch.bfloat16)
    backend = ReferenceAttentionBackend(layer, KVCacheSpec(2, 2, 8, torch.bfloat16))
    out = backend.forward(query, cache, backend.plan(batch))
    exact = per_token_oracle(query, cache, batch, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, exact.to(torch.bfloat16))  # within one bfloat16 rounding


def test_writes_each_key_and_value_at_its_slot_and_skips_minus_one():
    backend = ReferenceAttentionBackend(AttentionLayerSpec(2, 1, 4), KVCacheSpec(4, 1, 4, torch.float32))
    cache = torch.zeros(3, 2, 4, 1, 4)
    keys, values = torch.arange(12.0).view(3, 1, 4) + 1, -torch.arange(12.0).view(3, 1, 4) - 1
    backend.write_kv(keys, values, cache, torch.tensor([9, -1, 2]))
    expected = torch.zeros(3, 2, 4, 1, 4)
    expected[2, 0, 1], expected[2, 1, 1] = keys[0], values[0]
    expected[0, 0, 2], expected[0, 1, 2] = keys[2], values[2]
    assert torch.equal(cache, expected)


def test_writes_into_out_and_returns_it():
    layer = LAYERS["plain"]
    batch, cache = step([(1, 2)], 2, 2, 8, dtype=torch.float32)
    backend = ReferenceAttentionBackend(layer, KVCacheSpec(2, 2, 8, torch.float32))
    out = torch.full((2, 4, 8), float("nan"))
    assert backend.forward(torch.randn(2, 4, 8), cache, backend.plan(batch), out=out) is out
    assert torch.isfinite(out).all()


def test_accepts_float64_and_every_feature():
    request = SelectionRequest(device="cpu", dtype=torch.float64, head_size=72, block_size=3,
                               features=frozenset({"sliding_window", "logit_soft_cap", "alibi"}))
    assert ReferenceAttentionBackend.unsupported_reasons(request) == []


def test_refuses_heads_that_do_not_divide():
    with pytest.raises(UnsupportedConfigurationError, match="not a multiple"):
        ReferenceAttentionBackend(AttentionLayerSpec(6, 4, 8), KVCacheSpec(4, 4, 8, torch.float32))


def test_is_registered_through_its_entry_point_with_the_lowest_priority():
    registry = build_registry(environ={})
    registration = registry.get(ATTENTION_BACKEND, "reference")
    assert registration.plugin == "reference" and registration.cls is ReferenceAttentionBackend
    others = [r for r in registry.implementations(ATTENTION_BACKEND) if r.name != "reference"]
    assert all(r.cls.priority > ReferenceAttentionBackend.priority for r in others)
