"""The `quantizer` interface: lossy compression of KV caches and weights."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .api import QUANTIZER
from .implementation import Implementation

PER_TENSOR = "per_tensor"
PER_TOKEN = "per_token"
PER_CHANNEL = "per_channel"
GRANULARITIES = frozenset({PER_TENSOR, PER_TOKEN, PER_CHANNEL})


@dataclass
class QuantizedTensor:
    """Quantized `data` with the `scale` that maps it back: `x ≈ data * scale`,
    `scale` broadcastable against `data` at the quantizer's granularity."""

    data: torch.Tensor
    scale: torch.Tensor
    original_dtype: torch.dtype


class Quantizer(Implementation):
    """Guarantees every implementation keeps (the conformance suite checks each):
      1. `dequantize(quantize(x))` differs from `x` by at most `error_bound` times
         the largest magnitude in x's scale group, elementwise.
      2. The scale has the declared granularity's shape, and is finite and positive.
      3. Zeros, constant inputs and inputs with very large or tiny magnitudes do
         not produce NaN or infinity.
    """

    kind: ClassVar[str] = QUANTIZER
    storage_dtype: ClassVar[torch.dtype]
    granularity: ClassVar[str] = PER_TENSOR
    error_bound: ClassVar[float]

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {
            "storage_dtype": str(cls.storage_dtype).removeprefix("torch."),
            "granularity": cls.granularity,
            "error_bound": cls.error_bound,
        }

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize `x`; the last dimension is the channel dimension."""

    @abstractmethod
    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Map `q` back to `dtype` (default: the original dtype)."""
