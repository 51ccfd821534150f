"""The attention conformance checks can fail: each deliberately broken backend (in
tests/planted/attention_backends.py) is caught by the check written for the guarantee it breaks."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from kvforge.backends.reference import ReferenceAttentionBackend
from kvforge.conformance import (
    check_attention_decode,
    check_attention_features,
    check_attention_kv_write,
    check_attention_mixed,
    check_attention_prefill,
    check_attention_quantized_kv,
    check_attention_refusal,
)
from kvforge.conformance.attention_cases import (
    BLOCK_SIZES, SEED_ENV, TOLERANCES, Target, check_case, make_case, make_layer, oracle, relative_error,
)
from kvforge.conformance.attention_quick_grid import quick_lengths, quick_window
from kvforge.conformance.selection import QUICK_ENV, registry
from kvforge.core import ATTENTION_BACKEND, QUANTIZER, SLIDING_WINDOW, Registration, quantized_kv_views
from tests.planted.attention_backends import (
    AcceptsAnything,
    DecodeOneEarly,
    DecodeOneLate,
    DropsTokenOpeningABlock,
    HalfPrecisionInside,
    IgnoresAlibi,
    IgnoresContext,
    IgnoresContextInChunks,
    IgnoresScales,
    IgnoresSoftCap,
    IgnoresWindow,
    MixedBatchAsPrefill,
    QuantizedWritesMinusOne,
    ReadsBlockStartFromPreviousBlock,
    ReadsPadding,
    SkipsLastToken,
    SpillsIntoNextSlot,
    StoresUnscaled,
    WritesMinusOne,
    WrongHeadGroups,
)


@pytest.fixture(autouse=True)
def pinned_seed(monkeypatch):
    # The checks draw fresh seeds; pinned here so each mutant is caught on every run.
    monkeypatch.setenv(SEED_ENV, "1234")


def registration(cls) -> Registration:
    return Registration(ATTENTION_BACKEND, cls.name, cls, "test", "test", "0", (1, 0))


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


class RoundsNearTiesUp(ReferenceAttentionBackend):
    """Stores int8 codes as a device whose division rounds differently might,
    the quantizer's scales but codes of x / scale * (1 + 1e-3), so near-ties go one code up.
    The quantized-KV checks must accept it (they judge attention over the stored codes)."""

    name = "rounds-near-ties-up"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        super().write_kv(key, value, kv_cache, slot_mapping)
        if self.cache.storage_dtype != torch.int8:
            return
        data, scales = quantized_kv_views(kv_cache, self.cache)
        keep = slot_mapping >= 0
        blocks, offsets = slot_mapping[keep] // self.cache.block_size, slot_mapping[keep] % self.cache.block_size
        for index, x in ((0, key[keep]), (1, value[keep])):
            scale = scales[blocks, index, offsets].unsqueeze(-1)
            codes = (x.to(torch.float32) / scale * (1 + 1e-3)).round().clamp(-127, 127)
            data[blocks, index, offsets] = codes.to(data.dtype)


def test_quantized_forward_is_judged_over_the_codes_write_kv_stored():
    """A write that rounds near-ties to the other code (as a GPU's quantizer may) stores
    acceptable codes, so the forward check must judge attention over what was stored:
    against the CPU quantizer's codes the same output is outside the tolerance."""
    int8 = registry().get(QUANTIZER, "int8").cls()
    tgt = target(RoundsNearTiesUp)
    case = dataclasses.replace(make_case("mixed", make_layer(64, 4), 16, torch.float32, 7), quantizer=int8)
    out, over_stored = check_attention_quantized_kv.attend_over_stored(tgt, case)
    assert relative_error(out, over_stored) <= TOLERANCES[torch.float32]
    assert relative_error(out, oracle(case)) > TOLERANCES[torch.float32]
    check_attention_quantized_kv.test_quantized_kv_matches_reference_over_dequantized_values(
        registration(RoundsNearTiesUp), "chunked", torch.float32)
    check_attention_quantized_kv.test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(
        registration(RoundsNearTiesUp), 3)


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


# The quick grid: every planted bug caught on every seed, at every block size it may use

QUICK_SEEDS = (0, 1, 2, 3, 7, 1234, 99991, 2**31 - 1)
FEATURE_CHECKS = (check_attention_features,)
BATCH_CHECKS = (check_attention_decode, check_attention_prefill, check_attention_mixed)  # all dtypes, no features


def parametrizations(fn) -> list[dict]:
    """Every keyword set pytest would call check `fn` with (besides `registration`)."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            names = [n.strip() for n in mark.args[0].split(",")]
            axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    return [{k: v for axis in combo for k, v in axis.items()} for combo in itertools.product(*axes)]


def quick_checks(modules) -> list[tuple[str, functools.partial]]:
    """(label, check awaiting `registration`) for every test the modules hold, every parametrization."""
    return [(f"{module.__name__.rsplit('.', 1)[1]}::{name}{params}", functools.partial(fn, **params))
            for module in modules for name, fn in vars(module).items() if name.startswith("test_")
            for params in parametrizations(fn)]


def quick_run(cls, block_size: int, seed: int, modules, monkeypatch) -> str | None:
    """The first check of `modules` that `kvforge conformance --quick` would fail for
    `cls` declaring only `block_size` (its label and first line), or None."""
    monkeypatch.setenv(QUICK_ENV, "1")
    monkeypatch.setenv(SEED_ENV, str(seed))
    declared = type(cls.__name__, (cls,), {"block_sizes": frozenset({block_size})})
    for label, check in quick_checks(modules):
        threads = torch.get_num_threads()  # one check sets its own
        try:
            check(registration(declared))
        except pytest.skip.Exception:
            continue
        except Exception as exc:  # noqa: BLE001 (an assertion or a crash: pytest reports either as a failure)
            return f"{label}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        finally:
            torch.set_num_threads(threads)
    return None


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_quick_batches_hold_what_the_grid_promises(block_size):
    b, window = block_size, quick_window(block_size)
    decode, mixed = quick_lengths("decode", b), quick_lengths("mixed", b)
    assert (b, 1) in decode and (b, 1) in mixed  # a decode's new token opens block 2
    assert any(c + q == b + 1 for c, q in quick_lengths("prefill", b))  # so does a prompt's last token
    assert any(0 < c < b + 1 <= c + q and q > 1 for c, q in mixed)  # a chunk over context reaches block 2
    assert any(c + q == 2 * b for c, q in decode)  # a sequence fills its blocks exactly
    assert all(c + q > window for c, q in mixed if c + q > b)  # the window is shorter than the context


def test_the_reduced_grid_refuses_a_batch_kind_it_does_not_have():
    with pytest.raises(ValueError, match="no 'long' batches; its kinds: decode, prefill, chunked, mixed"):
        make_case("long", make_layer(64, 4), 16, torch.float32, seed=1, reduced=True)


def test_the_proof_runs_every_quick_attention_check():
    assert len(quick_checks(BATCH_CHECKS)) >= 15 and len(quick_checks(FEATURE_CHECKS)) >= 12
    assert any("decode" in label and "float32" in label for label, _ in quick_checks(BATCH_CHECKS))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reference_passes_the_quick_grid(block_size, monkeypatch):
    # The control for the test below: the grid fails the broken backends, not every backend.
    seed = QUICK_SEEDS[block_size % len(QUICK_SEEDS)]
    assert quick_run(ReferenceAttentionBackend, block_size, seed, BATCH_CHECKS + FEATURE_CHECKS, monkeypatch) is None


@pytest.mark.parametrize("cls, modules", [
    *[pytest.param(cls, FEATURE_CHECKS, id=cls.name) for cls in (IgnoresWindow, IgnoresSoftCap, IgnoresAlibi,
                                                                 DecodeOneLate)],
    *[pytest.param(cls, BATCH_CHECKS, id=cls.name) for cls in (
        WrongHeadGroups, ReadsBlockStartFromPreviousBlock, DropsTokenOpeningABlock, IgnoresContext,
        IgnoresContextInChunks, MixedBatchAsPrefill, DecodeOneEarly, ReadsPadding, HalfPrecisionInside,
        SkipsLastToken)],
])
def test_quick_grid_catches_every_planted_bug_on_every_seed(cls, modules, monkeypatch):
    """Caught by a part of the quick grid alone (the feature checks, or the plain
    batches every dtype runs), so caught by the whole grid."""
    missed = [(seed, block_size) for i, seed in enumerate(QUICK_SEEDS)
              for block_size in [BLOCK_SIZES[i % len(BLOCK_SIZES)]]
              if quick_run(cls, block_size, seed, modules, monkeypatch) is None]
    assert not missed, f"{cls.name} passed the quick grid at (seed, block size) {missed}"
