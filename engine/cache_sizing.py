"""How many KV blocks the pool gets.

`cache.num_blocks` wins when set. Otherwise `cache.memory_budget` is bytes
(>= 1) or a fraction (0, 1) of the memory available on the device, and the
pool gets as many blocks as fit: `budget // kv_cache_spec.bytes_per_block()`,
where a block's bytes cover keys and values of every layer in the cache dtype
(for a quantized cache: the storage dtype plus one float32 scale per token and
KV head, padded to 64 bytes per layer).
With neither set, the budget is 90% of free CUDA memory, or a fixed
`DEFAULT_CPU_BUDGET` on CPU (CPU runs are for tests and small models).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvforge.core import FLOAT_DTYPES, ConfigError, KVCacheSpec
from kvforge.core.config import CacheConfig

DEFAULT_CUDA_FRACTION = 0.9
DEFAULT_CPU_BUDGET = 256 * 2**20


def available_memory(device: str | torch.device = "cpu") -> int:
    """Free bytes on `device`: CUDA's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_spec(cache_config: CacheConfig, kv_cache_spec: KVCacheSpec) -> KVCacheSpec:
    """`kv_cache_spec` in the cache dtype: a float `kv_cache_dtype` replaces the model
    dtype; for a quantizer name the spec must already carry that quantizer (its
    `bytes_per_block` then counts the storage dtype and the scales)."""
    dtype = FLOAT_DTYPES.get(cache_config.kv_cache_dtype)
    if dtype is not None:
        return dataclasses.replace(kv_cache_spec, dtype=dtype)
    name = cache_config.kv_cache_dtype
    if name != "auto" and getattr(kv_cache_spec.quantizer, "name", None) != name:
        held = f"quantizer {kv_cache_spec.quantizer.name!r}" if kv_cache_spec.quantized else "no quantizer"
        raise ConfigError(f"cache.kv_cache_dtype names quantizer {name!r} but the KV cache spec has {held}; "
                          "size the cache with the model's spec (load_model(..., kv_quantizer=...), then "
                          "model.kv_cache_spec(block_size))")
    return kv_cache_spec


def num_blocks_for(cache_config: CacheConfig, kv_cache_spec: KVCacheSpec, available_bytes: int | None = None, *,
                   device: str | torch.device = "cpu", max_blocks: int | None = None) -> int:
    """The pool size for `cache_config` and a model whose KV cache has `kv_cache_spec`.

    `available_bytes` is what a fraction budget is a fraction of (measured on
    `device` when None). `max_blocks` caps the result (e.g. the most blocks the
    scheduler could ever fill). Raises ConfigError if not even one block fits.
    """
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    spec = cache_spec(cache_config, kv_cache_spec)
    if spec.block_size != cache_config.block_size:
        raise ConfigError(f"the KV cache spec has block size {spec.block_size} but cache.block_size is "
                          f"{cache_config.block_size}; build the spec with cache.block_size")
    budget = cache_config.memory_budget
    is_cuda = torch.device(device).type == "cuda"
    if budget is None:
        budget = DEFAULT_CUDA_FRACTION if is_cuda else DEFAULT_CPU_BUDGET
    if budget < 1:
        if available_bytes is None:
            available_bytes = available_memory(device)
        budget = budget * available_bytes
    per_block = spec.bytes_per_block()
    blocks = int(budget // per_block)
    if blocks < 1:
        scales = " with scales" if spec.quantized else ""
        raise ConfigError(f"cache.memory_budget gives {int(budget)} bytes, less than one KV block "
                          f"({per_block} bytes: {spec.num_layers} layers x 2 x {spec.block_size} tokens x "
                          f"{spec.num_kv_heads} heads x {spec.head_size} x {spec.storage_dtype}{scales}); "
                          f"raise cache.memory_budget, "
                          f"lower cache.block_size, or set cache.num_blocks")
    return min(blocks, max_blocks) if max_blocks is not None else blocks
