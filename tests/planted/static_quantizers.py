"""Broken static-scale quantizers, each breaking one promise of
`kvforge.core.StaticScaleQuantizer`; tests/test_quantizers_static_scale.py shows
the conformance check written for that promise catches it."""

from __future__ import annotations

import torch

from kvforge.core import QuantizedTensor
from kvforge.plugins.quantizers import Fp8E4m3PerTensorQuantizer, Fp8E5m2PerTensorQuantizer


class RescalesEachWrite(Fp8E4m3PerTensorQuantizer):
    """Declares a static scale but rescales every call by its own largest value: the
    tokens of one layer written in different steps end up at different scales, and
    FlashInfer's one k_scale would misread all but one step's."""

    name = "rescales-each-write"

    def quantize(self, x):
        self.check_finite(x)
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        scale = self.calibrated_scale(amax, 1.0)
        data = (x.float() / scale).clamp_(-self.max_value, self.max_value).to(self.storage_dtype)
        return QuantizedTensor(data, torch.tensor(scale, dtype=torch.float32), x.dtype)


class OverflowsToNaN(Fp8E4m3PerTensorQuantizer):
    """Writes NaN codes beyond 448 x scale, as a kernel casting to float8_e4m3fn without
    saturation does (the format has no Inf; torch's CPU cast happens to saturate)."""

    name = "overflows-to-nan"

    def quantize(self, x):
        self.check_finite(x)
        scale = self.fixed_scale()
        scaled = x.float() / scale
        scaled = torch.where(scaled.abs() > self.max_value, torch.full_like(scaled, float("nan")), scaled)
        return QuantizedTensor(scaled.to(self.storage_dtype), torch.tensor(scale), x.dtype)


class SaturatesToInf(Fp8E5m2PerTensorQuantizer):
    """Casts `x / scale` to float8_e5m2 without clamping: beyond 57344 x scale it holds Inf."""

    name = "saturates-to-inf"

    def quantize(self, x):
        self.check_finite(x)
        scale = self.fixed_scale()
        return QuantizedTensor((x.float() / scale).to(self.storage_dtype), torch.tensor(scale), x.dtype)


class ClaimsAWiderRange(Fp8E4m3PerTensorQuantizer):
    """Declares a saturation limit twice what it keeps (max_value 896 for e4m3's 448)."""

    name = "claims-a-wider-range"
    max_value = 896.0

    def quantize(self, x):
        self.check_finite(x)
        scale = self.fixed_scale()
        data = (x.float() / scale).clamp_(-448.0, 448.0).to(self.storage_dtype)
        return QuantizedTensor(data, torch.tensor(scale, dtype=torch.float32), x.dtype)
