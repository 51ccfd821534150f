"""`int4_unpacked`: the quantizer of docs/quantization.md, installable."""

import torch

from kvforge.core import PER_TOKEN, QuantizedTensor, Quantizer


class Int4UnpackedQuantizer(Quantizer):
    """Symmetric 4-bit codes (-7..7) stored one per int8, one scale per token and KV head.

    It shows the contract, not packing: the codes take as much memory as `int8`.
    Its storage dtype is int8, so any attention backend that reads an int8 KV
    cache (this package's `plain-torch`, kvforge's `reference`) serves
    `cache.kv_cache_dtype = "int4_unpacked"` unchanged."""

    name = "int4_unpacked"
    api_version = (1, 4)
    storage_dtype = torch.int8
    granularity = PER_TOKEN
    error_bound = 1 / 13  # half a step is 1/14 of the group max; the rest is float32 rounding

    def quantize(self, x):
        self.check_finite(x)
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        tiny = torch.finfo(torch.float32).tiny  # a scale below float32's normal range loses its bits
        scale = torch.where(amax > 0, (amax / 7).clamp_min(tiny), torch.ones_like(amax))
        data = (x.float() / scale).round().clamp(-7, 7).to(torch.int8)
        return QuantizedTensor(data, scale, x.dtype)

    def dequantize(self, q, dtype=None):
        return (q.data.float() * q.scale).to(dtype or q.original_dtype)
