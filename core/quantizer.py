"""The `quantizer` interface: lossy compression of KV caches and weights."""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .api import QUANTIZER
from .dtypes import dtype_name
from .errors import QuantizationError
from .implementation import Implementation

PER_TENSOR = "per_tensor"
PER_TOKEN = "per_token"
PER_CHANNEL = "per_channel"
GRANULARITIES = frozenset({PER_TENSOR, PER_TOKEN, PER_CHANNEL})


@dataclass
class QuantizedTensor:
    """Quantized `data` with the `scale` that maps it back: `x ≈ data.float() * scale`,
    `scale` float32 and broadcastable against `data` at the quantizer's granularity:
    `per_token` `[..., 1]` (one scale per row of the last dimension), `per_channel`
    `[rows, 1]` for a 2-D weight (one per output channel), `per_tensor` `[]`."""

    data: torch.Tensor
    scale: torch.Tensor
    original_dtype: torch.dtype


class Quantizer(Implementation):
    """Guarantees every implementation keeps (the conformance suite checks each):

      1. `dequantize(quantize(x))` differs from `x` by at most `error_bound` times
         the largest magnitude in x's scale group, elementwise.
      2. The scale has the declared granularity's shape, and is finite and positive.
      3. Zeros, constant inputs and inputs with very large or tiny magnitudes do
         not produce NaN or infinity; all-zero groups come back as exact zeros.
      4. NaN or infinite input raises `QuantizationError` naming the quantizer
         (`check_finite` does it), never silent garbage.

    The dequantization is always the linear map `data * scale`, so a host can
    dequantize inside its own kernels knowing only `storage_dtype`: a KV-cache
    quantizer (`cache.kv_cache_dtype = NAME`) must be `kv_capable()` (`per_token`,
    or a `StaticScaleQuantizer`), and any attention backend that reads its storage
    dtype serves it unchanged.

    A `StaticScaleQuantizer` (API 1.2) does not compute its scale from the data:
    the scale is fixed in advance, so guarantees 1 and 3 hold within its range
    and values beyond it saturate (see that class).
    """

    kind: ClassVar[str] = QUANTIZER
    storage_dtype: ClassVar[torch.dtype]
    granularity: ClassVar[str] = PER_TENSOR
    error_bound: ClassVar[float]
    static_scale: ClassVar[bool] = False
    """True only for a `StaticScaleQuantizer`: the scale is fixed in advance, not computed from the data."""

    @classmethod
    def kv_capable(cls) -> bool:
        """Whether `cache.kv_cache_dtype` may name it. The KV layout keeps one float32
        scale per (token, KV head): a `per_token` quantizer fills those slots with its
        own scales, a static-scale one with its layer's constant; any other
        granularity has no place there."""
        return cls.granularity == PER_TOKEN or (cls.static_scale and cls.granularity == PER_TENSOR)

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {
            "storage_dtype": dtype_name(cls.storage_dtype),
            "granularity": cls.granularity,
            "error_bound": cls.error_bound,
            "static_scale": cls.static_scale,
            "kv_capable": cls.kv_capable(),
        }

    def check_finite(self, x: torch.Tensor) -> None:
        """Raise `QuantizationError` if `x` holds NaN or infinity."""
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise QuantizationError(
                f"quantizer {self.name!r} was given {bad} NaN or infinite value(s) in a tensor of shape "
                f"{tuple(x.shape)}; quantized, they would turn into garbage. Find where they come from "
                "(an overflow in the model's dtype, or bad input) before quantizing")

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize `x`; the last dimension is the channel dimension."""

    @abstractmethod
    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Map `q` back to `dtype` (default: the original dtype)."""


class StaticScaleQuantizer(Quantizer):
    """A `per_tensor` quantizer whose one scale is fixed in advance (API 1.2): vLLM's
    `kv_cache_dtype="fp8"` with a per-layer `k_scale` / `v_scale`, which FlashInfer's
    fp8 kernels take as two floats.

    `cls(scale=s)` quantizes every tensor as `saturate(x / s)` in `storage_dtype`,
    whatever its values, so the same value always gets the same code (a KV cache
    may be written one token at a time). `scale=None` builds a template that a host
    calibrates before use (`with_scale(calibrated_scale(amax))`); quantizing with
    it raises. What it guarantees instead of the absmax guarantees 1 and 3 of
    `Quantizer`, for elements `x` in groups (the whole tensor) whose largest
    magnitude is at most `saturation_limit` (`scale * max_value`):

      1s. `|dequantize(quantize(x)) - x| <= error_bound * max(group max, precise_from)`,
          where `precise_from = scale * smallest_normal` (the format's smallest
          normal value): below it codes are subnormal, with an absolute step.
      3s. Beyond `saturation_limit`, a value comes back as `±saturation_limit`
          (within `error_bound` of it), never Inf or NaN: saturation is declared,
          not an error. Zeros come back as exact zeros; `scale` is the returned
          scale, finite and positive, for every input.

    Guarantees 2 and 4 hold unchanged, and each element's code depends on that
    element alone (a write of some tokens never changes the codes of others).
    """

    granularity: ClassVar[str] = PER_TENSOR
    static_scale: ClassVar[bool] = True
    max_value: ClassVar[float]
    """The format's largest finite value: the code `x / scale` saturates there."""
    smallest_normal: ClassVar[float]
    """The format's smallest normal value: below `scale * smallest_normal` the step is absolute."""

    def __init__(self, scale: float | None = 1.0):
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
                                      and float(scale) >= torch.finfo(torch.float32).tiny):
            raise QuantizationError(
                f"quantizer {self.name!r}: scale {scale!r} must be a finite positive float32 normal number "
                "(values dequantize as code * scale); give cache.kv_scales a positive number, or 'calibrate'")
        self.scale: float | None = None if scale is None else float(torch.tensor(float(scale), dtype=torch.float32))

    @property
    def calibrated(self) -> bool:
        return self.scale is not None

    @property
    def saturation_limit(self) -> float:
        """The largest magnitude kept: larger values come back as ± this."""
        return self.fixed_scale() * self.max_value

    @property
    def precise_from(self) -> float:
        """Group maxima from here up to `saturation_limit` keep the relative error bound."""
        return self.fixed_scale() * self.smallest_normal

    def fixed_scale(self) -> float:
        """The scale, or a `QuantizationError` saying how to set one when uncalibrated."""
        if self.scale is None:
            raise QuantizationError(
                f"quantizer {self.name!r} has no scale yet (built with scale=None, to be calibrated): "
                "call with_scale(calibrated_scale(amax)) first, or build it with a scale")
        return self.scale

    def with_scale(self, scale: float) -> "StaticScaleQuantizer":
        """The same quantizer with another fixed scale."""
        return type(self)(scale)

    @classmethod
    def calibrated_scale(cls, amax: float, headroom: float = 2.0) -> float:
        """The scale that puts `amax` (the largest magnitude seen, e.g. in a first
        prefill) at `1 / headroom` of the format's range, so later values up to
        `headroom` times larger still fit; an all-zero sample gets scale 1."""
        if not math.isfinite(amax) or amax < 0:
            raise QuantizationError(f"quantizer {cls.name!r}: cannot calibrate on a largest magnitude of {amax!r}")
        if amax == 0:
            return 1.0
        return max(amax * headroom / cls.max_value, torch.finfo(torch.float32).tiny)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale!r})"
