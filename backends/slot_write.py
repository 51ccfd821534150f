"""Writing new keys and values into an NHD paged cache by slot, in plain PyTorch.

Shared by the `flashinfer` and `xformers` backends, whose libraries have no
slot-mapping write that skips -1 entries. It is a helper module, not a plugin.
"""

from __future__ import annotations

import torch


def write_kv_by_slot(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store token `i`'s key and value (`[num_tokens, num_kv_heads, head_size]`) at
    `kv_cache[slot // block_size, 0 or 1, slot % block_size]`; slots equal to -1 are skipped."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[keep].to(kv_cache.dtype)
