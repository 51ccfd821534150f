"""Planted quantizers: the built-ins with one bug each, the bug in its docstring."""

from __future__ import annotations

import torch

from kvforge.core import QuantizationError, QuantizedTensor
from kvforge.plugins.quantizers import Fp8E4m3Quantizer, Int8Quantizer


class SquaredScales(Int8Quantizer):
    """Finds each row's largest magnitude through squares, as a norm would: 1e30 squared is inf in float32."""

    name = "squared-scales"

    def scales(self, x):
        amax = x.detach().float().pow(2).amax(dim=-1, keepdim=True).sqrt()
        return torch.where(amax > 0, amax / self.max_value, torch.ones_like(amax))


class OverclaimedBound(Int8Quantizer):
    """Claims an error bound int8 cannot keep."""

    name = "overclaimed-bound"
    error_bound = 1e-6


class ZeroScaleForZeros(Fp8E4m3Quantizer):
    """Scales a group of zeros by 0, so zeros come back as 0/0 = NaN."""

    name = "zero-scale"

    def scales(self, x):
        return x.detach().abs().amax(dim=-1, keepdim=True).float() / self.max_value


class SqueezedScales(Int8Quantizer):
    """Returns per_token scales without their trailing 1: `[tokens, heads]`, not `[tokens, heads, 1]`."""

    name = "squeezed-scales"

    def quantize(self, x):
        q = super().quantize(x)
        return QuantizedTensor(q.data, q.scale.squeeze(-1), q.original_dtype)

    def dequantize(self, q, dtype=None):
        return super().dequantize(QuantizedTensor(q.data, q.scale.unsqueeze(-1), q.original_dtype), dtype)


class AcceptsNaN(Int8Quantizer):
    """Never checks its input, so NaN becomes a quiet garbage code."""

    name = "accepts-nan"

    def check_finite(self, x):
        pass


class ChecksFirstRowOnly(Int8Quantizer):
    """Looks for NaN only where it is cheap: the first row."""

    name = "checks-first-row"

    def check_finite(self, x):
        super().check_finite(x.reshape(-1, x.shape[-1])[0])


class NamelessError(Int8Quantizer):
    """Refuses NaN, but its message does not say which quantizer refused."""

    name = "nameless-error"

    def check_finite(self, x):
        if not bool(torch.isfinite(x).all()):
            raise QuantizationError("input holds NaN or infinity")


class StochasticRounding(Int8Quantizer):
    """Rounds up or down at random: unbiased on average, but never the same twice."""

    name = "stochastic-rounding"

    def quantize(self, x):
        self.check_finite(x)
        scale = self.scales(x)
        scaled = (x.float() / scale + torch.rand(x.shape)).floor_().clamp_(-self.max_value, self.max_value)
        return QuantizedTensor(scaled.to(self.storage_dtype), scale, x.dtype)


class DividesInPlace(Int8Quantizer):
    """Divides by the scale in place; `x.float()` of a float32 tensor is the tensor itself."""

    name = "divides-in-place"

    def quantize(self, x):
        self.check_finite(x)
        scale = self.scales(x)
        scaled = x.float().div_(scale).round_().clamp_(-self.max_value, self.max_value)
        return QuantizedTensor(scaled.to(self.storage_dtype), scale, x.dtype)


class ZeroPointUint8(Int8Quantizer):
    """Stores uint8 codes around a zero point of 128: a fine round trip, but
    `data * scale` (what backends compute) is off by 128 steps."""

    name = "zero-point-uint8"
    storage_dtype = torch.uint8

    def quantize(self, x):
        q = super().quantize(x)
        return QuantizedTensor((q.data.to(torch.int16) + 128).to(torch.uint8), q.scale, q.original_dtype)

    def dequantize(self, q, dtype=None):
        return ((q.data.float() - 128) * q.scale).to(dtype or q.original_dtype)


class PerTensorInDisguise(Int8Quantizer):
    """One scale for the whole tensor, broadcast to the per_token shape."""

    name = "per-tensor-in-disguise"

    def scales(self, x):
        rows = super().scales(x.reshape(1, -1))
        return rows.reshape(()).expand(*x.shape[:-1], 1).contiguous()


class AsymmetricInt8(Int8Quantizer):
    """Spends the code -128 by scaling with amax/128, so +amax clips to 127/128 of itself."""

    name = "asymmetric-int8"

    def quantize(self, x):
        self.check_finite(x)
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
        scale = torch.where(amax > 0, amax / 128, torch.ones_like(amax))
        data = (x.float() / scale).round_().clamp_(-128, 127).to(torch.int8)
        return QuantizedTensor(data, scale, x.dtype)


class AlwaysFloat32(Int8Quantizer):
    """Ignores the dtype asked for and the input's dtype."""

    name = "always-float32"

    def dequantize(self, q, dtype=None):
        return q.data.float() * q.scale


class UnknownGranularity(Int8Quantizer):
    """Declares a granularity the interface does not know."""

    name = "unknown-granularity"
    granularity = "per_row"


class ExactClaim(Int8Quantizer):
    """Claims to be lossless: an error bound of 0."""

    name = "exact-claim"
    error_bound = 0.0


PLANTED = [
    SquaredScales, OverclaimedBound, ZeroScaleForZeros, SqueezedScales, AcceptsNaN, ChecksFirstRowOnly,
    NamelessError, StochasticRounding, DividesInPlace, ZeroPointUint8, PerTensorInDisguise, AsymmetricInt8,
    AlwaysFloat32, UnknownGranularity, ExactClaim,
]
