"""Built-in quantizers: `fp8_e4m3`, `fp8_e5m2` and `int8` for the KV cache (one
float32 scale per token and KV head), `int8_weight` for linear weights (one per
output channel), and `fp8_e4m3_per_tensor` / `fp8_e5m2_per_tensor`, static-scale
fp8 for the KV cache (one fixed scale per layer for keys and one for values,
vLLM's `kv_cache_dtype="fp8"`, the form FlashInfer's fp8 kernels read).

Every one is absmax scaling: a group's largest magnitude maps to the format's
largest finite value, so nothing saturates and an outlier only coarsens its own
group. A group of zeros gets scale 1 (never 0 or a division by zero) and comes
back as exact zeros. `error_bound` is the worst rounding error relative to the
group's largest magnitude: half a step at the top of the range, which is
about 1/(2*127) for int8 and half an ulp (2^-4 for e4m3, 2^-3 for e5m2) for fp8;
values below the format's normal range round to subnormals whose absolute step
is far smaller than that.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvforge.core import PER_CHANNEL, PER_TOKEN, QuantizedTensor, Quantizer, StaticScaleQuantizer, hookimpl


class LinearDequantize:
    """The dequantization every built-in quantizer shares: the linear map `data * scale`
    the contract promises (`kvforge.core.Quantizer`)."""

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (q.data.float() * q.scale).to(dtype or q.original_dtype)


class AbsmaxQuantizer(LinearDequantize, Quantizer):
    """Scale each group (a row of the last dimension) by its largest magnitude."""

    max_value: ClassVar[float]  # the largest finite value of `storage_dtype`
    rounds_to_integers: ClassVar[bool] = False

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
        scale = amax / self.max_value
        # Zero groups get scale 1; a scale that underflowed to zero (tiny inputs) the smallest normal.
        scale = torch.where(amax > 0, scale.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(scale))
        return scale

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        self.check_finite(x)
        scale = self.scales(x)
        scaled = x.float() / scale
        if self.rounds_to_integers:
            scaled = scaled.round_()
        data = scaled.clamp_(-self.max_value, self.max_value).to(self.storage_dtype)
        return QuantizedTensor(data, scale, x.dtype)


class Fp8E4m3Quantizer(AbsmaxQuantizer):
    """fp8 e4m3 (`torch.float8_e4m3fn`, 3 mantissa bits, up to 448), per token: vLLM's `fp8_e4m3`."""

    name = "fp8_e4m3"
    priority = 20
    storage_dtype = torch.float8_e4m3fn
    granularity = PER_TOKEN
    max_value = float(torch.finfo(torch.float8_e4m3fn).max)
    error_bound = 2.0 ** -4


class Fp8E5m2Quantizer(AbsmaxQuantizer):
    """fp8 e5m2 (`torch.float8_e5m2`, 2 mantissa bits, up to 57344), per token."""

    name = "fp8_e5m2"
    priority = 10
    storage_dtype = torch.float8_e5m2
    granularity = PER_TOKEN
    max_value = float(torch.finfo(torch.float8_e5m2).max)
    error_bound = 2.0 ** -3


class Int8Quantizer(AbsmaxQuantizer):
    """Symmetric int8 (-127..127, round to nearest), per token."""

    name = "int8"
    priority = 15
    storage_dtype = torch.int8
    granularity = PER_TOKEN
    max_value = 127.0
    rounds_to_integers = True
    error_bound = 1.0 / 252  # half a step (1/254) plus float32 rounding of x / scale


class Int8WeightQuantizer(Int8Quantizer):
    """Symmetric int8 weights, one scale per output channel (row of a `[out, in]` weight)."""

    name = "int8_weight"
    priority = 0
    granularity = PER_CHANNEL


class StaticFp8Quantizer(LinearDequantize, StaticScaleQuantizer):
    """fp8 with one fixed scale: `x / scale` rounded to the nearest fp8 value,
    saturating at the format's largest finite value (torch's own cast would give
    NaN for e4m3fn and Inf for e5m2 there). Rounding to nearest with m mantissa
    bits is off by at most half an ulp, 2^-(m+1) of the value, so `error_bound` is
    that; below the smallest normal the absolute step is `scale * 2^-(m+bias-1)`,
    whose half is `error_bound * precise_from`."""

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        self.check_finite(x)
        scale = self.fixed_scale()
        data = (x.float() / scale).clamp_(-self.max_value, self.max_value).to(self.storage_dtype)
        return QuantizedTensor(data, torch.tensor(scale, dtype=torch.float32, device=x.device), x.dtype)


class Fp8E4m3PerTensorQuantizer(StaticFp8Quantizer):
    """fp8 e4m3 with a fixed per-tensor scale (up to 448 x scale): vLLM's `fp8` / `fp8_e4m3`."""

    name = "fp8_e4m3_per_tensor"
    priority = 5
    storage_dtype = torch.float8_e4m3fn
    max_value = float(torch.finfo(torch.float8_e4m3fn).max)
    smallest_normal = float(torch.finfo(torch.float8_e4m3fn).smallest_normal)
    error_bound = 2.0 ** -4


class Fp8E5m2PerTensorQuantizer(StaticFp8Quantizer):
    """fp8 e5m2 with a fixed per-tensor scale (up to 57344 x scale): vLLM's `fp8_e5m2`."""

    name = "fp8_e5m2_per_tensor"
    priority = 4
    storage_dtype = torch.float8_e5m2
    max_value = float(torch.finfo(torch.float8_e5m2).max)
    smallest_normal = float(torch.finfo(torch.float8_e5m2).smallest_normal)
    error_bound = 2.0 ** -3


@hookimpl
def kvforge_implementations():
    return [Fp8E4m3Quantizer, Fp8E5m2Quantizer, Int8Quantizer, Int8WeightQuantizer,
            Fp8E4m3PerTensorQuantizer, Fp8E5m2PerTensorQuantizer]
