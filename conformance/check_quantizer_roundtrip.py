"""Conformance of every `quantizer`: guarantees 1-3 of `kvforge.core.Quantizer`,
the round trip. Each element of `dequantize(quantize(x))` must lie within the
declared `error_bound` times the largest magnitude of its scale group, on fresh
random data in float32 and bfloat16: normal data at magnitudes from 1e-3 to 1e4,
outliers, all-zero and constant groups, values exactly at ± the group maximum,
and group maxima at the edges of float32's range. A static-scale quantizer
(`kvforge.core.StaticScaleQuantizer`) is judged against its input saturated at
its `saturation_limit`, each element by at least `precise_from` (its guarantees
1s and 3s; `check_quantizer_static_scale` checks the rest).

Inputs are shaped by granularity (see `kvforge.conformance.quantizer_cases`):
`per_token` quantizers, the only ones `cache.kv_cache_dtype` may name, get
KV-shaped `[tokens, kv_heads, head_size]` tensors; `per_channel` ones 2-D
`[out, in]` weights; `per_tensor` ones tensors of any shape.
"""

import pytest
import torch

from kvforge.conformance.attention_cases import fresh_seed
from kvforge.conformance.quantizer_cases import (
    INPUT_DTYPES,
    describe,
    group_rows,
    magnitudes_per_group,
    random_input,
    roundtrip_problem,
    scale_problem,
    shapes,
)
from kvforge.core import QUANTIZER

KIND = QUANTIZER
GROUP = "roundtrip"

MAGNITUDES = (1e-3, 1e-1, 1.0, 1e2, 1e4)
FLOAT32 = torch.finfo(torch.float32)


@pytest.fixture
def quantizer(registration):
    return registration.cls()


def check_all(quantizer, cases, floor: float = 0.0) -> None:
    problems = [roundtrip_problem(quantizer, x, where, floor) for x, where in cases]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_error_stays_within_the_bound_at_every_magnitude(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        for magnitude in MAGNITUDES:
            x = (torch.randn(shape, generator=gen) * magnitude).to(dtype)
            cases.append((x, describe(x, f"normal data × {magnitude:g}", seed)))
        # groups of very different magnitudes in one call: each is judged by its own maximum
        maxima = magnitudes_per_group(shape, quantizer.granularity, gen, -3, 4)
        x = random_input(shape, quantizer.granularity, gen, maxima, dtype)
        cases.append((x, describe(x, "group maxima from 1e-3 to 1e4", seed)))
    check_all(quantizer, cases)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_outliers_keep_every_element_within_the_bound_of_its_group(quantizer, dtype):
    """A few values 100x the rest: an absmax quantizer coarsens that group's step
    but clips nothing; one that scales by a percentile or saturates fails here."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        x = torch.randn(shape, generator=gen)
        count = max(1, x.numel() // 50)
        where = torch.randperm(x.numel(), generator=gen)[:count]
        signs = torch.randint(0, 2, (count,), generator=gen) * 2 - 1
        x.view(-1)[where] = signs * 100 * x.abs().max()
        x = x.to(dtype)
        cases.append((x, describe(x, f"{count} outlier(s) 100x the rest", seed)))
    check_all(quantizer, cases)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_all_zero_groups_come_back_as_exact_zeros_with_finite_positive_scales(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    problems = []
    for shape in shapes(quantizer):
        some_zero = torch.randn(shape, generator=gen)
        rows = group_rows(some_zero, quantizer.granularity)
        rows[torch.rand(rows.shape[0], generator=gen) < 0.5] = 0.0
        for x, label in ((torch.zeros(shape), "all zeros"), (some_zero, "some groups all zero")):
            x = x.to(dtype)
            where = describe(x, label, seed)
            q = quantizer.quantize(x)
            problems.append(scale_problem(quantizer, q, where))
            zero_groups = group_rows(x, quantizer.granularity).eq(0).all(dim=-1)
            for out_dtype in (torch.float32, dtype):
                back = group_rows(quantizer.dequantize(q, out_dtype), quantizer.granularity)[zero_groups]
                if not bool((back == 0).all()):
                    problems.append(f"{quantizer.name}: {where}: all-zero groups came back as "
                                    f"{back[back != 0][:4].tolist()} in {out_dtype}, not exact zeros")
            problems.append(roundtrip_problem(quantizer, x, where))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_constant_groups_round_trip_within_the_bound(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        maxima = magnitudes_per_group(shape, quantizer.granularity, gen, -3, 4)
        maxima = maxima * (torch.randint(0, 2, maxima.shape, generator=gen) * 2 - 1)  # both signs
        x = torch.ones(shape, dtype=torch.float64)
        rows = group_rows(x, quantizer.granularity)
        rows.mul_(maxima.reshape(-1, 1))
        x = x.to(dtype)
        cases.append((x, describe(x, "constant groups of either sign", seed)))
    check_all(quantizer, cases)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_values_exactly_at_plus_and_minus_the_group_max_round_trip(quantizer, dtype):
    """Both ends of a symmetric range must be reachable: an int8 quantizer that
    scales by amax/128 to use -128 clips +amax to 127/128 of itself and fails."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        maxima = magnitudes_per_group(shape, quantizer.granularity, gen, -3, 4)
        x = random_input(shape, quantizer.granularity, gen, maxima, torch.float64) * 0.5
        rows = group_rows(x, quantizer.granularity)
        rows[:, 0] = maxima
        if rows.shape[1] > 1:
            rows[:, -1] = -maxima
        x = x.to(dtype)
        cases.append((x, describe(x, "± the group max in every group", seed)))
        cases.append((-x, describe(x, "∓ the group max in every group", seed)))
    check_all(quantizer, cases)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_group_maxima_at_the_edges_of_float32_round_trip_within_the_bound(quantizer, dtype):
    """Group maxima of 1e30, half of float32's largest value, and 1e-30.

    These are the edges an absmax quantizer handles exactly: the scale
    (amax / format max) is a normal float32 for all three even for a format
    max of 57344 (1e-30 / 57344 ≈ 1.7e-35 > 1.2e-38), and rebuilding the group
    max as data × scale rounds up by at most an ulp or two, which half of
    float32's max leaves room for (float32's max itself may overflow to inf
    there, so it is not asked). 1e30 squared overflows float32, so a scale
    computed through squares (a norm) is caught. bfloat16 shares float32's
    exponent range, so the same maxima apply to it."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        for maximum in (1e30, FLOAT32.max / 2, 1e-30):
            x = random_input(shape, quantizer.granularity, gen, maximum, dtype)
            cases.append((x, describe(x, f"group max {maximum:.3g}", seed)))
    check_all(quantizer, cases)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_subnormal_sized_groups_come_back_finite_within_one_smallest_normal(quantizer, dtype):
    """Group maxima of 1e-40 and 1e-44, below float32's smallest normal (1.2e-38).

    Their exact scale (amax / format max) would be a float32 subnormal with few
    significant bits, or zero, so a quantizer may clamp the scale at the
    smallest normal, as the built-ins do; values far below it then flush
    towards zero. What must still hold: finite, positive scales, no NaN or
    infinity, and an error within `error_bound` × group max plus one smallest
    normal float32. (In bfloat16, 1e-44 rounds to zero: an all-zero group.)"""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes(quantizer):
        for maximum in (1e-40, 1e-44):
            x = random_input(shape, quantizer.granularity, gen, maximum, dtype)
            cases.append((x, describe(x, f"group max {maximum:.3g}", seed)))
    check_all(quantizer, cases, floor=FLOAT32.tiny)
