"""The attention conformance checks can fail: each deliberately broken backend below
is caught by the check written for the guarantee it breaks."""

from __future__ import annotations

import pytest
import torch

from kvforge.backends.reference import ReferenceAttentionBackend, attend, gather_sequence
from kvforge.conformance import (
    check_attention_features,
    check_attention_kv_write,
    check_attention_mixed,
    check_attention_prefill,
    check_attention_quantized_kv,
    check_attention_refusal,
)
from kvforge.conformance.attention_cases import SEED_ENV, Target, check_case, make_case, make_layer
from kvforge.core import ATTENTION_BACKEND, SLIDING_WINDOW, Registration, quantized_kv_views


@pytest.fixture(autouse=True)
def pinned_seed(monkeypatch):
    # The checks draw fresh seeds; pinned here so each mutant is caught on every run.
    monkeypatch.setenv(SEED_ENV, "1234")


def registration(cls) -> Registration:
    return Registration(ATTENTION_BACKEND, cls.name, cls, "test", "test", "0", (1, 0))


class IgnoresContext(ReferenceAttentionBackend):
    """Attends only to this step's tokens, as if every sequence were a fresh prompt."""

    name = "ignores-context"

    def forward(self, query, kv_cache, plan, out=None):
        out = torch.empty_like(query) if out is None else out
        for b, (context, seq_len) in enumerate(zip(plan.context_lens, plan.seq_lens)):
            start, end = plan.query_starts[b], plan.query_starts[b + 1]
            keys, values = gather_sequence(kv_cache, plan.batch.block_table[b], seq_len)
            out[start:end] = attend(query[start:end], keys[context:], values[context:], 0, self.layer).to(out.dtype)
        return out


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


class IgnoresWindow(ReferenceAttentionBackend):
    """Declares sliding windows but attends to the whole sequence."""

    name = "ignores-window"

    def forward(self, query, kv_cache, plan, out=None):
        saved = self.layer
        self.layer = type(saved)(saved.num_heads, saved.num_kv_heads, saved.head_size, saved.scale, None,
                                 saved.logit_soft_cap, saved.alibi_slopes)
        try:
            return super().forward(query, kv_cache, plan, out)
        finally:
            self.layer = saved


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


class ReadsPadding(ReferenceAttentionBackend):
    """Gathers every column of the block table, padding included, and relies on the
    causal mask alone (masked scores get weight 0, but 0 times NaN is NaN)."""

    name = "reads-padding"

    def forward(self, query, kv_cache, plan, out=None):
        out = torch.empty_like(query) if out is None else out
        width = plan.batch.block_table.shape[1] * kv_cache.shape[2]
        for b, (context, seq_len) in enumerate(zip(plan.context_lens, plan.seq_lens)):
            start, end = plan.query_starts[b], plan.query_starts[b + 1]
            keys, values = gather_sequence(kv_cache, plan.batch.block_table[b], width)
            out[start:end] = attend(query[start:end], keys, values, context, self.layer).to(out.dtype)
        return out


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


def target(cls) -> Target:
    return Target(cls, "cpu", reduced=False)


def test_reference_itself_passes_a_mixed_case():
    case = make_case("mixed", make_layer(64, 4), 8, torch.float32, seed=1)
    assert check_case(target(ReferenceAttentionBackend), case) is None


@pytest.mark.parametrize("cls, kind, dtype", [
    (IgnoresContext, "chunked", torch.float32),
    (WrongHeadGroups, "decode", torch.float32),
    (HalfPrecisionInside, "prefill", torch.float32),
    (SkipsLastToken, "mixed", torch.bfloat16),
], ids=lambda v: getattr(v, "name", str(v)))
def test_wrong_attention_is_caught(cls, kind, dtype):
    case = make_case(kind, make_layer(64, 4), 8, dtype, seed=3)
    assert check_case(target(cls), case) is not None


def test_unwritten_output_is_reported_as_not_written():
    case = make_case("mixed", make_layer(64, 4), 8, torch.float32, seed=4)
    assert "not written" in check_case(target(SkipsLastToken), case)


def test_reading_block_table_padding_is_caught():
    case = make_case("decode", make_layer(64, 1), 8, torch.float32, seed=7)
    assert "not finite" in check_case(target(ReadsPadding), case)


def test_ignored_sliding_window_is_caught():
    case = make_case("long", make_layer(64, 1, sliding_window=20), 16, torch.float32, seed=5)
    assert check_case(target(IgnoresWindow), case) is not None


def test_writing_slot_minus_one_is_caught():
    with pytest.raises(AssertionError, match="differ"):
        check_attention_kv_write.test_write_skips_slots_marked_minus_one(registration(WritesMinusOne), 5)


def test_writing_outside_the_slot_is_caught():
    with pytest.raises(AssertionError, match="differ"):
        check_attention_kv_write.test_write_puts_each_token_exactly_at_its_slot_and_nowhere_else(
            registration(SpillsIntoNextSlot), torch.float32)


def test_accepting_an_undeclared_configuration_is_caught():
    with pytest.raises(AssertionError, match="constructed"):
        check_attention_refusal.test_undeclared_configurations_are_refused_with_reasons(registration(AcceptsAnything))
    case = make_case("mixed", make_layer(64, 1, sliding_window=4), 8, torch.float32, seed=6)
    assert "accepted" in check_case(target(AcceptsAnything), case)


def test_check_modules_fail_as_a_whole_on_a_broken_backend():
    with pytest.raises(AssertionError):
        check_attention_mixed.test_one_plan_serves_every_layer_of_a_step(registration(IgnoresContext), torch.float32)
    with pytest.raises(AssertionError):
        check_attention_prefill.test_prefill_matches_float64_reference(registration(HalfPrecisionInside), "aligned",
                                                                       torch.float32)
    with pytest.raises(AssertionError):
        check_attention_features.test_feature_matches_float64_reference(registration(IgnoresWindow), SLIDING_WINDOW,
                                                                        torch.float32)


def test_ignoring_quantization_scales_is_caught():
    with pytest.raises(AssertionError, match="relative error"):
        check_attention_quantized_kv.test_quantized_kv_matches_reference_over_dequantized_values(
            registration(IgnoresScales), "mixed", torch.float32)
    with pytest.raises(AssertionError, match="from attention over the float KV"):
        check_attention_quantized_kv.test_quantized_kv_stays_near_attention_over_float_kv(
            registration(IgnoresScales), "decode", torch.float32)


def test_a_quantized_write_without_scales_is_caught():
    with pytest.raises(AssertionError, match="scales differ"):
        check_attention_quantized_kv.test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(
            registration(StoresUnscaled), 0)


def test_a_quantized_write_to_slot_minus_one_is_caught():
    check_attention_quantized_kv.test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(
        registration(QuantizedWritesMinusOne), 0)  # nothing skipped: indistinguishable from correct
    with pytest.raises(AssertionError, match="scales differ|outside the written slots changed"):
        check_attention_quantized_kv.test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(
            registration(QuantizedWritesMinusOne), 3)


def test_a_backend_declaring_no_quantized_kv_is_skipped_with_the_reason():
    float_only = type("FloatOnly", (ReferenceAttentionBackend,), {"name": "float-only",
                                                                  "quantized_kv_dtypes": frozenset()})
    with pytest.raises(pytest.skip.Exception, match="declares no quantized KV dtypes"):
        check_attention_quantized_kv.test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(
            registration(float_only), 0)
