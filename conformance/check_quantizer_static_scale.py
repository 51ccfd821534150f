"""Conformance of every static-scale `quantizer` (`kvforge.core.StaticScaleQuantizer`,
guarantees 1s and 3s): what a fixed scale promises instead of absmax scaling.

- the scale returned is the fixed one, whatever the data, so a KV cache written
  one step at a time holds one scale per layer (a quantizer that rescales by each
  call's largest value fails);
- within the range (`precise_from` .. `saturation_limit`) the round trip keeps
  `error_bound`, at scales far from 1 too;
- beyond it, values saturate to ± the limit, never Inf or NaN (torch's plain cast
  to float8_e4m3fn gives NaN there, to float8_e5m2 Inf);
- `calibrated_scale(amax)` puts `amax` inside the range; a template built with
  `scale=None` refuses to quantize, naming itself.

Dynamic (absmax) quantizers are not applicable here (reported "n/a"): `roundtrip`
holds them to guarantee 1.
"""

import re

import pytest
import torch

from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import fresh_seed
from kvforge.conformance.quantizer_cases import INPUT_DTYPES, describe, roundtrip_problem, same_bits, shapes
from kvforge.conformance.selection import QuickGrid
from kvforge.core import QUANTIZER, QuantizationError

KIND = QUANTIZER
GROUP = "static scale"

SCALES = QuickGrid(full=(1e-3, 0.37, 1.0, 50.0), quick=(1e-3, 50.0))


@pytest.fixture
def quantizer(registration):
    if not registration.cls.static_scale:
        not_applicable("dynamic (absmax) scales; the roundtrip group checks them")
    return registration.cls()


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_the_returned_scale_is_the_fixed_one_whatever_the_data(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for scale in SCALES:
        fixed = quantizer.with_scale(scale)
        for magnitude in (1e-3, 1.0, 1e3):
            x = (torch.randn(shapes(fixed)[0], generator=gen) * magnitude * scale).to(dtype)
            got = fixed.quantize(x).scale
            assert got.numel() == 1 and got.item() == fixed.scale, (
                f"{quantizer.name}: scale {fixed.scale:g}, {describe(x, f'data x {magnitude:g}', seed)}: returned "
                f"scale {got.reshape(-1)[:2].tolist()}, not the fixed one; a KV cache written step by step would "
                "hold tokens of one layer at different scales")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_each_code_depends_on_its_element_alone(quantizer, dtype):
    """A slice quantized alone gives the codes it gets inside the whole tensor."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        x = (torch.randn(shape, generator=gen) * 100).to(dtype)
        x.view(-1)[0] = 1e4  # one large value: it must not change anybody else's code
        whole = quantizer.quantize(x).data.reshape(-1)
        for part in (slice(0, 1), slice(1, None)):
            alone = quantizer.quantize(x.reshape(-1)[part]).data
            assert same_bits(whole[part], alone), (
                f"{quantizer.name}: {describe(x, f'elements {part.start}:{part.stop}', seed)} quantized alone give "
                "other codes than inside the whole tensor")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_round_trip_keeps_the_bound_inside_the_range_at_every_scale(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    problems = []
    for scale in SCALES:
        fixed = quantizer.with_scale(scale)
        for shape in shapes(fixed):
            for fraction in (1.0, 0.3, 1e-2):  # the group max at these fractions of the limit
                x = torch.randn(shape, generator=gen, dtype=torch.float64)
                x = (x / x.abs().max().clamp_min(1e-30) * fixed.saturation_limit * fraction).to(dtype)
                problems.append(roundtrip_problem(fixed, x, describe(x, f"scale {scale:g}, max at {fraction:g} "
                                                                         "of the limit", seed)))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_values_beyond_the_range_saturate_to_the_limit_never_inf_or_nan(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for scale in SCALES:
        fixed = quantizer.with_scale(scale)
        limit = fixed.saturation_limit
        for factor in (1.5, 1e3, 1e30 / limit):
            x = torch.randn(shapes(fixed)[0], generator=gen).sign() * limit * factor
            x = x.to(dtype)
            where = describe(x, f"scale {scale:g}, values {factor:.3g} x the limit {limit:.4g}", seed)
            back = fixed.dequantize(fixed.quantize(x), torch.float64)
            assert bool(torch.isfinite(back).all()), f"{quantizer.name}: {where}: came back with Inf or NaN"
            error = (back - x.double().clamp(-limit, limit)).abs().max().item()
            assert error <= fixed.error_bound * limit, (
                f"{quantizer.name}: {where}: came back up to {error:.4g} away from ± the limit, not saturated")


def test_a_calibrated_scale_holds_the_sample_and_an_uncalibrated_template_refuses(quantizer):
    for amax in (1e-20, 3e-3, 1.0, 7e4):
        scale = quantizer.calibrated_scale(amax, 2.0)
        fixed = quantizer.with_scale(scale)
        assert fixed.precise_from <= amax <= fixed.saturation_limit, (
            f"{quantizer.name}: calibrated_scale({amax:g}) = {scale:g} keeps {fixed.precise_from:g} .. "
            f"{fixed.saturation_limit:g}, which does not hold the sample's {amax:g}")
    assert quantizer.calibrated_scale(0.0) > 0, f"{quantizer.name}: an all-zero sample must still give a scale"
    template = quantizer.with_scale(1.0)
    template.scale = None
    with pytest.raises(QuantizationError, match=re.escape(quantizer.name)):
        template.quantize(torch.ones(4))
