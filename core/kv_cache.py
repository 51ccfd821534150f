"""The paged KV cache's layout: what one layer's cache tensor holds and how it is
read and written.

A cache is `[num_blocks, 2, block_size, num_kv_heads, head_size]` (NHD: keys at
index 0 of dim 1, values at 1) in the compute dtype; a quantized one is
`[num_blocks, layer_block_bytes]` bytes, each block's data and its float32
scales side by side in one row (`quantized_kv_views`). Block tables address
blocks; a token's slot is `block * block_size + offset`. `attention` builds the
backend contract on top of this; the engine's cache manager allocates to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .quantizer import Quantizer

NHD = "NHD"
"""The default KV layout: `[num_blocks, 2, block_size, num_kv_heads, head_size]`,
index 0 of dim 1 holding keys and 1 values. FlashInfer (NHD), the Triton kernels
and xformers all read it without copying."""


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one layer's paged KV cache, and how many layers there are.

    With a `quantizer`, keys and values are stored in its `storage_dtype` with one
    float32 scale per (token, KV head) (`x ≈ data * scale`), and `dtype` is what
    attention computes in. Each block then holds its data and its scales together
    in one row of bytes (see `quantized_kv_views`), so a block id covers both:
    allocation, prefix sharing, copy-on-write and eviction never know the
    difference.

    With a static-scale quantizer (`StaticScaleQuantizer`, one scale per tensor)
    the layout is the same: every written slot's scale is the layer's constant,
    `kv_scales` = (key scale, value scale), or the quantizer's own scale for both
    when None. Backends that read the scale slots need nothing else; one that
    takes a scale per tensor (FlashInfer's `k_scale` / `v_scale`) reads
    `kv_scales_or_default()` on the host, with no device sync."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    num_layers: int = 1
    quantizer: Quantizer | None = None
    kv_scales: tuple[float, float] | None = None

    @property
    def static_scales(self) -> bool:
        """Whether keys and values carry one fixed scale per layer (a static-scale quantizer)."""
        return self.quantizer is not None and self.quantizer.static_scale

    def kv_scales_or_default(self) -> tuple[float, float]:
        """The layer's (key scale, value scale) of a static-scale quantizer, as stored
        (float32 values): `kv_scales`, or the quantizer's own scale for both."""
        if not self.static_scales:
            raise ValueError("kv_scales_or_default: this KV cache has no static-scale quantizer")
        key, value = self.key_value_quantizers
        return key.scale, value.scale

    @functools.cached_property
    def key_value_quantizers(self) -> tuple[Quantizer, Quantizer]:
        """The quantizers of keys and of values: the same one, or, for a static-scale
        quantizer, one per scale of `kv_scales` (the quantizer itself when None)."""
        if not self.static_scales:
            return self.quantizer, self.quantizer
        if self.kv_scales is None:
            self.quantizer.fixed_scale()  # an uncalibrated template: say so here
            return self.quantizer, self.quantizer
        return self.quantizer.with_scale(self.kv_scales[0]), self.quantizer.with_scale(self.kv_scales[1])

    @property
    def quantized(self) -> bool:
        return self.quantizer is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype keys and values are stored in."""
        return self.quantizer.storage_dtype if self.quantizer is not None else self.dtype

    @property
    def tensor_dtype(self) -> torch.dtype:
        """The dtype of one layer's cache tensor: raw bytes when quantized."""
        return torch.uint8 if self.quantized else self.dtype

    def data_bytes(self) -> int:
        """Bytes of one layer's keys and values in one block (scales excluded)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.storage_dtype.itemsize

    def scale_offset(self) -> int:
        """Where a quantized block's scales start in its row of bytes (16-byte aligned)."""
        return cdiv(self.data_bytes(), 16) * 16

    def layer_block_bytes(self) -> int:
        """Bytes of one layer's block; a quantized block is padded to 64 bytes so
        every block starts on a cache line."""
        if not self.quantized:
            return self.data_bytes()
        scales = 2 * self.block_size * self.num_kv_heads * SCALE_DTYPE.itemsize
        return cdiv(self.scale_offset() + scales, 64) * 64

    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers (keys, values and any scales)."""
        return self.layer_block_bytes() * self.num_layers


SCALE_DTYPE = torch.float32
"""The dtype of a quantized KV cache's per-(token, KV head) scales."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def quantized_kv_views(kv_cache: torch.Tensor, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The two views of one layer's quantized cache (`[num_blocks, layer_block_bytes]`
    uint8): data `[num_blocks, 2, block_size, num_kv_heads, head_size]` in the
    storage dtype (the NHD layout, with a block stride of `layer_block_bytes`), and
    scales `[num_blocks, 2, block_size, num_kv_heads]` float32. Writing through
    either writes the cache."""
    num_blocks = kv_cache.shape[0]
    shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads)
    data = kv_cache[:, :spec.data_bytes()].view(spec.storage_dtype).view(*shape, spec.head_size)
    offset = spec.scale_offset()
    scales = kv_cache[:, offset:offset + 2 * spec.block_size * spec.num_kv_heads * SCALE_DTYPE.itemsize]
    return data, scales.view(SCALE_DTYPE).view(shape)


@dataclass
class PagedCSR:
    """The block table as FlashInfer-style kernels read it.

    `indices[indptr[b]:indptr[b+1]]` are sequence `b`'s blocks in order, and
    `last_page_len[b]` is how many slots of its last block are filled (1..block_size).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def paged_csr(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagedCSR:
    """Derive the CSR view from the dense block table; the one place this is done."""
    seq_lens = seq_lens.to(torch.int32)
    blocks_per_seq = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(blocks_per_seq, 0, out=indptr[1:])
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    used = columns.unsqueeze(0) < blocks_per_seq.unsqueeze(1)
    indices = block_table[used].to(torch.int32)
    last_page_len = torch.where(seq_lens > 0, (seq_lens - 1) % block_size + 1, torch.zeros_like(seq_lens))
    return PagedCSR(indptr=indptr, indices=indices, last_page_len=last_page_len)


def write_kv_by_slot(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store token `i`'s key and value at `kv_cache[slot // block_size, 0 or 1, slot % block_size]`
    in the NHD layout, skipping slots equal to -1; the one plain-PyTorch cache write."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[keep].to(kv_cache.dtype)


def write_quantized_kv_by_slot(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, spec: KVCacheSpec) -> None:
    """`write_kv_by_slot` for a quantized cache: `spec.quantizer` quantizes each
    token's key and value per KV head, and data and scale land at the same slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // spec.block_size, slots % spec.block_size
    data, scales = quantized_kv_views(kv_cache, spec)
    if spec.static_scales:  # one fixed scale for the keys, one for the values: each slot gets its tensor's
        for index, (x, quantizer) in enumerate(zip((key, value), spec.key_value_quantizers)):
            q = quantizer.quantize(x[keep])
            data[blocks, index, offsets] = q.data
            scales[blocks, index, offsets] = q.scale.to(SCALE_DTYPE).expand(q.data.shape[:-1])
        return
    q = spec.quantizer.quantize(torch.stack((key[keep], value[keep]), dim=1))  # one call: [T, 2, H, D]
    data[blocks, :, offsets] = q.data
    scales[blocks, :, offsets] = q.scale.reshape(q.data.shape[:-1]).to(SCALE_DTYPE)


def dequantize_kv_blocks(kv_cache: torch.Tensor, spec: KVCacheSpec, blocks: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """The keys and values of `blocks` (int64 block ids) as `dtype`, `[len(blocks), 2,
    block_size, num_kv_heads, head_size]`: a copy of just those blocks, for backends
    that compute over float keys (never a copy of the whole cache)."""
    data, scales = quantized_kv_views(kv_cache, spec)
    return (data[blocks].to(torch.float32) * scales[blocks].unsqueeze(-1)).to(dtype)
