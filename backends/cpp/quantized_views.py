"""The two views of a quantized KV cache (`kvforge.core.quantized_kv_views`), made
per call from strides worked out once per cache layout.

`quantized_kv_views` slices, reinterprets and reshapes a layer's rows of bytes,
several tensor ops a call; the cpp backend needs the views in `write_kv` and
`forward` of every layer of every step. The layout does not depend on the
number of blocks, so `QuantizedViews` asks `quantized_kv_views` once, on two
blocks, and from then on makes the same views with one `as_strided` each, about
a third of the cost: the layout stays defined in one place, core.
"""

from __future__ import annotations

import torch

from kvforge.core import SCALE_DTYPE, KVCacheSpec, quantized_kv_views


class QuantizedViews:
    """`views(kv_cache)` is `quantized_kv_views(kv_cache, spec)`, made faster."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.row_bytes = spec.layer_block_bytes()
        # Two blocks, not one: a size-1 dimension's stride says nothing.
        data, scales = quantized_kv_views(torch.zeros(2, self.row_bytes, dtype=torch.uint8), spec)
        self.data_layout = (tuple(data.shape[1:]), data.stride(), data.storage_offset())
        self.scale_layout = (tuple(scales.shape[1:]), scales.stride(), scales.storage_offset())

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (kv_cache.dtype == torch.uint8 and kv_cache.dim() == 2 and kv_cache.shape[1] == self.row_bytes
                and kv_cache.is_contiguous()):
            raise ValueError(
                f"a KV cache quantized to {self.spec.storage_dtype} must be a contiguous uint8 tensor "
                f"[num_blocks, {self.row_bytes}] (AttentionBackend.kv_cache_shape), got {kv_cache.dtype} "
                f"{tuple(kv_cache.shape)}; allocate it with kv_cache_shape and spec.tensor_dtype")
        return self._view(kv_cache, self.spec.storage_dtype, self.data_layout), self._view(
            kv_cache, SCALE_DTYPE, self.scale_layout)

    @staticmethod
    def _view(kv_cache: torch.Tensor, dtype: torch.dtype, layout) -> torch.Tensor:
        # Offsets count from the cache's own start, which need not be its storage's
        # (a cache may be a view of a larger mapping: models/huge_pages.py).
        shape, stride, offset = layout
        typed = kv_cache.view(dtype)
        return typed.as_strided((kv_cache.shape[0], *shape), stride, typed.storage_offset() + offset)
