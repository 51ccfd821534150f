"""Conformance of every `attention_backend` that reads a quantized KV cache
(guarantee 6 of `kvforge.core.AttentionBackend`).

A backend declaring storage dtypes in `quantized_kv_dtypes` is run with every
registered KV-capable quantizer whose storage dtype and scale granularity it
declares (`per_token`, or a static-scale `per_tensor` one with its default scale;
found through the registry, so a third-party quantizer is checked with it), on
decode, prefill, chunked and mixed batches, in every dtype it declares:

(a) its output matches the float64 reference computed over the dequantized keys
    and values (`data * scale`) within guarantee 3's tolerance for the dtype. The
    reference reads back what the backend's `write_kv` stored: a quantizer run on
    a GPU may round a near-tie to the other code than on the CPU (seen on an H200
    with fp8_e5m2, where one code step is 12.5% of a value), and whether the stored
    codes are the quantizer's is (c)'s question, not this one's;
(b) its output stays within `drift_tolerance` of attention over the original,
    unquantized keys and values: `DRIFT_FACTOR * error_bound` in relative norm
    (plus the dtype's own tolerance). Why that factor: a quantizer's
    `error_bound` is its worst rounding error relative to the largest magnitude
    of the group (one token and KV head), and the checks' Gaussian keys and
    values have a group maximum below 4 standard deviations for head sizes up to
    256. Values then carry at most `4 * error_bound` relative error, and the
    weighted average attention takes keeps that ratio; keys perturb each score
    (`q . k / sqrt(d)`, about unit variance) by at most `4 * error_bound`, which
    moves the output by about as much relative to itself. The two are
    independent, so together at most `sqrt(2) * 4 ≈ 5.7` times `error_bound`;
    `DRIFT_FACTOR` is 6. (Measured 2026-11-30 over 200 `sdpa` cases per
    quantizer, head sizes 64 and 128: at most 2.3x `error_bound` for int8 and
    0.6x for fp8.) A backend that drops the scales or reads the wrong rows is
    far outside it;
(c) `write_kv` stores what the quantizer gives: read back through
    `quantized_kv_views`, each written slot's scale equals the quantizer's (to
    float32 rounding) and its dequantized values are within two rounding errors
    (`2 * error_bound` times the group's largest magnitude) of the quantizer's,
    so a kernel may round a tie the other way but not store anything else;
    slots marked -1, the other slots and the padding keep every byte.

Backends that declare no quantized KV dtype are skipped, saying so.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND, PER_TENSOR, PER_TOKEN, QUANTIZER, KVCacheSpec, Quantizer, quantized_kv_views,
)
from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import (
    DTYPES, TOLERANCES, Case, Target, check_case, fresh_seed, make_case, make_layer, mismatch, oracle, prepared_cache,
    relative_error, report, run_step, target,
)
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)
from kvforge.conformance.selection import registry

KIND = ATTENTION_BACKEND
GROUP = "quantized kv"
HEAVY = True  # runs after its kind's light groups: a broken implementation fails those in seconds
pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ("decode", "prefill", "chunked", "mixed")
DRIFT_FACTOR = 6.0


def kv_quantizers(tgt: Target) -> list[Quantizer]:
    """An instance of every registered per_token quantizer whose storage dtype the
    backend declares, or a pytest skip saying why there is none."""
    declared = tgt.cls.quantized_kv_dtypes
    if not declared:
        not_applicable(f"{tgt.name} declares no quantized KV dtypes (quantized_kv_dtypes is empty): "
                    "it reads float KV caches only")
    granularities = tgt.cls.kv_scale_granularities
    found = [r.cls() for r in registry().implementations(QUANTIZER)
             if r.cls.kv_capable() and r.cls.storage_dtype in declared
             and (PER_TENSOR if r.cls.static_scale else PER_TOKEN) in granularities]
    if not found:
        pytest.skip(f"no registered KV-capable quantizer with {' or '.join(sorted(granularities))} scales stores "
                    f"{sorted(str(d) for d in declared)}, the quantized KV dtypes {tgt.name} declares")
    return found


def drift_tolerance(quantizer: Quantizer, dtype: torch.dtype) -> float:
    """How far (relative norm) attention over a cache quantized by `quantizer` may be
    from attention over the original keys and values; see the module docstring."""
    return DRIFT_FACTOR * quantizer.error_bound + TOLERANCES[dtype]


def quantized_cases(tgt: Target, kind: str, dtype: torch.dtype) -> list[Case]:
    """One case of `kind` per quantizer, at one block size (16 where declared) and the
    first declared head size, four query heads per KV head."""
    block_size = sorted(tgt.block_sizes(), key=lambda b: abs(b - 16))[0]
    layer = make_layer(tgt.head_sizes()[0], 4)
    seed, cases = fresh_seed(), []
    for i, quantizer in enumerate(kv_quantizers(tgt)):
        case = make_case(kind, layer, block_size, dtype, seed + i, tgt.reduced)
        cases.append(dataclasses.replace(case, quantizer=quantizer, kv_scales=layer_kv_scales(quantizer),
                                         label=f"{case.label} kv_cache_dtype={quantizer.name}"))
    return cases


def layer_kv_scales(quantizer: Quantizer) -> tuple[float, float] | None:
    """For a static-scale quantizer, a layer's own key and value scales, unlike each other
    and the quantizer's default (a backend taking one of the others is caught), with
    room for the checks' Gaussian keys and values (up to 16 and 8); None otherwise."""
    if not quantizer.static_scale:
        return None
    return quantizer.calibrated_scale(16.0, 1.0), quantizer.calibrated_scale(8.0, 1.0)


def declared_dtype(tgt: Target, dtype: torch.dtype) -> None:
    if dtype not in tgt.cls.dtypes:
        not_applicable(f"{tgt.name} does not declare {dtype}")


def attend_over_stored(tgt: Target, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(the backend's output for `case`, the float64 reference over the keys and values
    its `write_kv` stored, read back and dequantized)."""
    spec = case.cache_spec()
    backend = tgt.cls(case.layer, spec, tgt.device)
    cache = prepared_cache(backend, case, tgt.device)
    out = run_step(backend, case, tgt.device, cache=cache)
    data, scales = quantized_kv_views(cache.cpu(), spec)

    def stored(slots: torch.Tensor, index: int) -> torch.Tensor:
        blocks, offsets = slots // case.block_size, slots % case.block_size
        return (data[blocks, index, offsets].to(torch.float32) * scales[blocks, index, offsets].unsqueeze(-1)
                ).to(torch.float64)

    new_slots = case.batch.slot_mapping
    as_stored = dataclasses.replace(case, quantizer=None, context_keys=stored(case.context_slots, 0),
                                    context_values=stored(case.context_slots, 1), new_keys=stored(new_slots, 0),
                                    new_values=stored(new_slots, 1))
    return out, oracle(as_stored)


def check_over_stored(tgt: Target, case: Case) -> str | None:
    if tgt.reasons(case.layer, case.block_size, case.dtype, case.quantizer):
        return check_case(tgt, case)  # must be refused; check_case says whether it is
    return mismatch(*attend_over_stored(tgt, case), case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_kv_matches_reference_over_dequantized_values(registration, kind, dtype):
    tgt = target(registration)
    declared_dtype(tgt, dtype)
    report([check_over_stored(tgt, case) for case in quantized_cases(tgt, kind, dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_kv_stays_near_attention_over_float_kv(registration, kind, dtype):
    tgt = target(registration)
    declared_dtype(tgt, dtype)
    problems = []
    for case in quantized_cases(tgt, kind, dtype):
        if tgt.reasons(case.layer, case.block_size, dtype, case.quantizer):
            continue  # refusing is checked by the test above
        out = run_step(tgt.cls(case.layer, case.cache_spec(), tgt.device), case, tgt.device)
        error = relative_error(out, oracle(dataclasses.replace(case, quantizer=None)))
        tolerance = drift_tolerance(case.quantizer, dtype)
        if not error <= tolerance:
            problems.append(f"{case.label}: relative error {error:.3g} from attention over the float KV > "
                            f"{tolerance:.3g} ({DRIFT_FACTOR:g} x error_bound {case.quantizer.error_bound:.3g})")
    report(problems)


def write_round_trip(tgt: Target, quantizer: Quantizer, dtype: torch.dtype, block_size: int, head_size: int,
                     seed: int, skipped: int) -> str | None:
    """Write random tokens at random distinct slots (`skipped` of them -1) into a cache
    of random bytes; why the result is wrong, or None."""
    layer = make_layer(head_size, 4)
    scales = layer_kv_scales(quantizer)  # x4: this check's keys and values are 4x larger
    spec = KVCacheSpec(block_size, layer.num_kv_heads, head_size, dtype, quantizer=quantizer,
                       kv_scales=None if scales is None else (4 * scales[0], 4 * scales[1]))
    backend = tgt.cls(layer, spec, tgt.device)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = random.Random(seed).randint(3, 9)
    tokens = random.Random(seed + 1).randint(1, num_blocks * block_size)
    skipped = min(skipped, tokens - 1)  # at least one token is written
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:skipped]] = -1
    shape = (tokens, layer.num_kv_heads, head_size)
    keys, values = (torch.randn(shape, generator=gen).mul_(4).to(dtype) for _ in range(2))
    before = torch.randint(0, 256, type(backend).kv_cache_shape(num_blocks, spec), generator=gen, dtype=torch.uint8)
    cache = before.to(tgt.device)
    backend.write_kv(keys.to(tgt.device), values.to(tgt.device), cache, slots.to(tgt.device))
    cache = cache.cpu()
    label = (f"kv_cache_dtype={quantizer.name} block_size={block_size} head_size={head_size} dtype={dtype} "
             f"{tokens} tokens ({skipped} with slot -1) seed={seed}")
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    data, scales = quantized_kv_views(cache, spec)
    for index, x in ((0, keys), (1, values)):
        expected = spec.key_value_quantizers[index].quantize(x[keep])
        got_scale = scales[blocks, index, offsets]
        want_scale = expected.scale.to(torch.float32).expand(*expected.data.shape[:-1], 1).reshape(got_scale.shape)
        if not torch.allclose(got_scale, want_scale, rtol=1e-6, atol=0):
            return f"{label}: stored {'keys' if index == 0 else 'values'} scales differ from the quantizer's"
        got = data[blocks, index, offsets].to(torch.float32) * got_scale.unsqueeze(-1)
        want = expected.data.to(torch.float32) * want_scale.unsqueeze(-1)
        room = 2 * quantizer.error_bound * x[keep].float().abs().amax(-1, keepdim=True)
        if not bool(((got - want).abs() <= room).all()):
            worst = float(((got - want).abs() - room).max())
            return (f"{label}: stored {'keys' if index == 0 else 'values'} dequantize to more than two rounding "
                    f"errors from the quantizer's (worst by {worst:.3g})")
    restored = cache.clone()  # put back what was written; nothing else may have changed
    restored_data, restored_scales = quantized_kv_views(restored, spec)
    before_data, before_scales = quantized_kv_views(before, spec)
    restored_data[blocks, :, offsets] = before_data[blocks, :, offsets]
    restored_scales[blocks, :, offsets] = before_scales[blocks, :, offsets]
    if not torch.equal(restored, before):
        changed = (restored != before).nonzero()
        return (f"{label}: {len(changed)} bytes outside the written slots changed, first at [block, byte]="
                f"{changed[0].tolist()}")
    return None


@pytest.mark.parametrize("skipped", [0, 3])
def test_write_kv_stores_what_the_quantizer_gives_and_nothing_else(registration, skipped):
    tgt = target(registration)
    quantizers = kv_quantizers(tgt)
    seed = fresh_seed()
    report([write_round_trip(tgt, q, dtype, block_size, tgt.head_sizes()[0], seed + 10 * i + j, skipped)
            for i, q in enumerate(quantizers) for j, (dtype, block_size) in
            enumerate((d, b) for d in tgt.dtypes() for b in tgt.block_sizes()[:2])])
