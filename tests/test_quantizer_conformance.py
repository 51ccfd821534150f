"""The quantizer conformance checks can fail: each planted quantizer
(tests/planted/quantizers.py) is caught by the check written for the guarantee it
breaks, a broken third-party plugin fails `kvforge conformance`, and the built-ins pass it all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvforge.conformance import check_quantizer_contract as contract
from kvforge.conformance import check_quantizer_roundtrip as roundtrip
from kvforge.conformance.attention_cases import SEED_ENV
from kvforge.conformance.runner import check_modules
from kvforge.core import QUANTIZER, Registration, build_registry
from tests.planted.quantizers import (
    AcceptsNaN,
    AlwaysFloat32,
    AsymmetricInt8,
    ChecksFirstRowOnly,
    DividesInPlace,
    ExactClaim,
    NamelessError,
    OverclaimedBound,
    PerTensorInDisguise,
    SquaredScales,
    SqueezedScales,
    StochasticRounding,
    UnknownGranularity,
    ZeroPointUint8,
    ZeroScaleForZeros,
)


@pytest.fixture(autouse=True)
def pinned_seed(monkeypatch):
    # The checks draw fresh seeds; pinned here so each broken quantizer is caught on every run.
    monkeypatch.setenv(SEED_ENV, "1234")


def registration(cls) -> Registration:
    return Registration(QUANTIZER, cls.name, cls, "test", "test", "0", (1, 0))


# The round trip

def test_scales_that_overflow_to_inf_are_caught_at_the_float32_edges():
    with pytest.raises(AssertionError, match="not finite and positive"):
        roundtrip.test_group_maxima_at_the_edges_of_float32_round_trip_within_the_bound(SquaredScales(), torch.float32)
    # ordinary data hides it
    roundtrip.test_error_stays_within_the_bound_at_every_magnitude(SquaredScales(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_error_bound_that_is_not_kept_is_caught(dtype):
    with pytest.raises(AssertionError, match="outside error_bound 1e-06"):
        roundtrip.test_error_stays_within_the_bound_at_every_magnitude(OverclaimedBound(), dtype)


def test_zeros_that_come_back_nan_are_caught():
    with pytest.raises(AssertionError, match="not exact zeros") as caught:
        roundtrip.test_all_zero_groups_come_back_as_exact_zeros_with_finite_positive_scales(
            ZeroScaleForZeros(), torch.float32)
    assert "nan" in str(caught.value) and "scales are not finite and positive" in str(caught.value)


def test_one_scale_for_the_whole_tensor_is_caught_by_groups_of_different_magnitudes():
    with pytest.raises(AssertionError, match="outside error_bound"):
        roundtrip.test_error_stays_within_the_bound_at_every_magnitude(PerTensorInDisguise(), torch.float32)
    with pytest.raises(AssertionError, match="quantized alone differ"):
        contract.test_each_group_quantizes_the_same_whatever_else_is_in_the_call(PerTensorInDisguise(), torch.float32)


def test_a_plus_max_that_clips_is_caught():
    with pytest.raises(AssertionError, match="outside error_bound"):
        roundtrip.test_values_exactly_at_plus_and_minus_the_group_max_round_trip(AsymmetricInt8(), torch.float32)


def test_each_round_trip_failure_names_quantizer_case_seed_and_worst_element():
    with pytest.raises(AssertionError) as caught:
        roundtrip.test_error_stays_within_the_bound_at_every_magnitude(OverclaimedBound(), torch.float32)
    message = str(caught.value)
    for fragment in ("overclaimed-bound:", "seed 1234", "worst at (", "input float32", "allowed error"):
        assert fragment in message


# The contract

def test_a_wrong_scale_shape_is_caught():
    with pytest.raises(AssertionError, match=r"input \(5, 2, 16\): scale shape \(5, 2\); expected \(5, 2, 1\)"):
        contract.test_quantize_returns_storage_dtype_data_of_the_input_shape_and_scales_of_the_granularity_shape(
            SqueezedScales(), torch.float32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_or_inf_accepted_silently_is_caught(bad):
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        contract.test_nan_or_infinity_anywhere_raises_a_quantization_error_naming_the_quantizer(
            AcceptsNaN(), bad, torch.float32)


def test_nan_outside_the_rows_a_quantizer_inspects_is_caught():
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        contract.test_nan_or_infinity_anywhere_raises_a_quantization_error_naming_the_quantizer(
            ChecksFirstRowOnly(), float("nan"), torch.float32)


def test_a_refusal_that_does_not_name_the_quantizer_is_caught():
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        contract.test_nan_or_infinity_anywhere_raises_a_quantization_error_naming_the_quantizer(
            NamelessError(), float("nan"), torch.float32)


def test_non_deterministic_output_is_caught():
    with pytest.raises(AssertionError, match="quantized twice gave different data or scales"):
        contract.test_the_same_input_quantizes_to_identical_data_and_scales_and_is_left_unchanged(
            StochasticRounding(), torch.float32)


def test_changing_the_input_is_caught():
    with pytest.raises(AssertionError, match="quantize changed its input"):
        contract.test_the_same_input_quantizes_to_identical_data_and_scales_and_is_left_unchanged(
            DividesInPlace(), torch.float32)


def test_a_zero_point_is_caught_by_the_linear_map_and_the_kv_layout():
    # its own round trip is fine
    roundtrip.test_error_stays_within_the_bound_at_every_magnitude(ZeroPointUint8(), torch.float32)
    with pytest.raises(AssertionError, match="differs from data \\* scale"):
        contract.test_dequantize_is_data_times_scale(ZeroPointUint8(), torch.float32)
    with pytest.raises(AssertionError, match="stored in the KV cache layout"):
        contract.test_kv_capable_quantizers_round_trip_through_the_kv_cache_block_layout(
            ZeroPointUint8(), torch.float32)


def test_ignoring_the_dtype_asked_for_is_caught():
    with pytest.raises(AssertionError, match="not the input's torch.bfloat16"):
        contract.test_dequantize_returns_the_input_dtype_by_default_and_the_dtype_asked_for(
            AlwaysFloat32(), torch.bfloat16)


@pytest.mark.parametrize("cls, fragment",
                         [(UnknownGranularity, "granularity 'per_row'"), (ExactClaim, "error_bound 0.0")],
                         ids=["granularity", "error-bound"])
def test_impossible_declarations_are_caught(cls, fragment):
    with pytest.raises(AssertionError, match=fragment):
        contract.test_declares_a_storage_dtype_a_known_granularity_and_an_error_bound_in_0_1(registration(cls))


def test_weight_quantizers_are_not_stored_as_kv():
    weights = build_registry(environ={}).get(QUANTIZER, "int8_weight").cls()
    with pytest.raises(pytest.skip.Exception, match="not KV-capable"):
        contract.test_kv_capable_quantizers_round_trip_through_the_kv_cache_block_layout(weights, torch.float32)


# Through the runner and the command line

def kvforge(*args, env=None, cwd=None):
    # wide enough that rich wraps neither a matrix row nor a failure line
    return subprocess.run([sys.executable, "-m", "kvforge", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "1000", **(env or {})}, cwd=cwd, timeout=300)


def test_every_builtin_quantizer_passes_every_quantizer_check_group(tmp_path):
    groups = [group for _, _, group in check_modules([QUANTIZER])]
    assert sorted(groups) == ["contract", "roundtrip", "static scale"]
    result = kvforge("conformance", "--kind", QUANTIZER, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    for name, static in (("fp8_e4m3", False), ("fp8_e5m2", False), ("int8", False), ("int8_weight", False),
                         ("fp8_e4m3_per_tensor", True), ("fp8_e5m2_per_tensor", True)):
        (row,) = [line for line in result.stdout.splitlines() if f" {name} " in line]
        assert row.count("pass") == (len(groups) if static else len(groups) - 1), row  # static scale: skipped


THIRD_PARTY_PLUGIN = '''
import torch
from kvforge.core import PER_TENSOR, PER_TOKEN, QuantizedTensor, Quantizer, hookimpl

class SloppyInt8(Quantizer):
    """Skips check_finite and scales zeros by 0."""
    name = "sloppy-int8"
    storage_dtype = torch.int8
    granularity = PER_TOKEN
    error_bound = 1.0 / 252

    def quantize(self, x):
        scale = x.abs().amax(dim=-1, keepdim=True).float() / 127
        return QuantizedTensor((x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale, x.dtype)

    def dequantize(self, q, dtype=None):
        return (q.data.float() * q.scale).to(dtype or q.original_dtype)

class TensorInt8(SloppyInt8):
    """A correct per_tensor int8: one scale for the whole tensor."""
    name = "tensor-int8"
    granularity = PER_TENSOR

    def quantize(self, x):
        self.check_finite(x)
        amax = x.abs().amax().float()
        scale = torch.where(amax > 0, (amax / 127).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
        return QuantizedTensor((x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale, x.dtype)

@hookimpl
def kvforge_implementations():
    return [SloppyInt8, TensorInt8]
'''


def documented_example() -> str:
    """The quantizer plugin written out in docs/quantization.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "quantization.md").read_text()
    (block,) = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("python") and "@hookimpl" in b]
    return block


def test_third_party_quantizers_are_judged_by_kvforge_conformance(fake_site, tmp_path):
    fake_site.add("fakeplug-quant", "0.1", {"fakeplug_quant": THIRD_PARTY_PLUGIN}, {"quant": "fakeplug_quant"})
    fake_site.add("fakeplug-int4", "0.1", {"fakeplug_int4": documented_example()}, {"int4": "fakeplug_int4"})
    result = kvforge("conformance", "--kind", QUANTIZER, "--plugin", "sloppy-int8", "--plugin", "tensor-int8",
                     "--plugin", "int4", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "int8_weight" not in result.stdout
    for name in ("tensor-int8", "int4_unpacked"):  # a correct per_tensor one, and the documented example
        (good,) = [line for line in result.stdout.splitlines() if f" {name} " in line]
        assert good.count("pass") == 2, result.stdout
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failures and all("[sloppy-int8-" in line for line in failures)  # each failure names its implementation
    assert any("check_quantizer_contract::test_nan_or_infinity_anywhere_raises" in line
               and "DID NOT RAISE QuantizationError" in line for line in failures)
    assert any("check_quantizer_roundtrip::test_all_zero_groups_come_back_as_exact_zeros" in line
               and "scales are not finite and positive" in line for line in failures)
