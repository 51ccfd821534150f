"""The `quantizer` interface: lossy compression of KV caches and weights."""

from __future__ import annotations

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
    quantizer (`cache.kv_cache_dtype = NAME`) must be `per_token`, and any
    attention backend that reads its storage dtype serves it unchanged.
    """

    kind: ClassVar[str] = QUANTIZER
    storage_dtype: ClassVar[torch.dtype]
    granularity: ClassVar[str] = PER_TENSOR
    error_bound: ClassVar[float]

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {
            "storage_dtype": dtype_name(cls.storage_dtype),
            "granularity": cls.granularity,
            "error_bound": cls.error_bound,
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
