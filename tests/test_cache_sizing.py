"""How many KV blocks a cache config buys for a model's KV shape."""

import pytest
import torch

from kvforge.core import ConfigError, KVCacheSpec
from kvforge.core.config import CacheConfig
from kvforge.engine.cache_sizing import DEFAULT_CPU_BUDGET, available_memory, num_blocks_for

# 2 layers x 2 (K, V) x 16 tokens x 4 heads x 8 dims x 4 bytes = 8 KiB per block
SPEC = KVCacheSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float32, num_layers=2)
BLOCK_BYTES = 8 * 1024


def test_bytes_per_block_covers_keys_values_and_every_layer():
    assert SPEC.bytes_per_block() == BLOCK_BYTES


def test_num_blocks_wins_over_a_budget():
    assert num_blocks_for(CacheConfig(num_blocks=7, memory_budget="1GiB"), SPEC) == 7


def test_a_byte_budget_buys_whole_blocks():
    assert num_blocks_for(CacheConfig(memory_budget=10 * BLOCK_BYTES + 5), SPEC) == 10
    assert num_blocks_for(CacheConfig(memory_budget="1MiB"), SPEC) == 128


def test_a_fraction_is_of_the_available_memory():
    assert num_blocks_for(CacheConfig(memory_budget=0.25), SPEC, available_bytes=400 * BLOCK_BYTES) == 100


def test_a_float_cache_dtype_replaces_the_model_dtype():
    half = num_blocks_for(CacheConfig(memory_budget="1MiB", kv_cache_dtype="float16"), SPEC)
    assert half == 2 * num_blocks_for(CacheConfig(memory_budget="1MiB"), SPEC)


def test_a_quantized_cache_is_sized_by_the_storage_dtype_in_the_spec():
    int8 = KVCacheSpec(16, 4, 8, torch.int8, num_layers=2)
    assert num_blocks_for(CacheConfig(memory_budget="1MiB", kv_cache_dtype="fp8"), int8) == 512


def test_no_setting_gives_the_default_cpu_budget():
    assert num_blocks_for(CacheConfig(), SPEC) == DEFAULT_CPU_BUDGET // BLOCK_BYTES


def test_max_blocks_caps_the_pool():
    assert num_blocks_for(CacheConfig(memory_budget="1MiB"), SPEC, max_blocks=5) == 5


def test_a_budget_below_one_block_is_refused_with_the_block_cost():
    with pytest.raises(ConfigError, match=r"less than one KV block \(8192 bytes"):
        num_blocks_for(CacheConfig(memory_budget=100), SPEC)


def test_the_spec_must_use_the_configured_block_size():
    with pytest.raises(ConfigError, match="block size 16 but cache.block_size is 32"):
        num_blocks_for(CacheConfig(block_size=32, memory_budget="1MiB"), SPEC)


def test_available_memory_is_measured_on_the_host():
    assert available_memory("cpu") > 0
