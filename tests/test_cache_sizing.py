"""How many KV blocks a cache config buys for a model's KV shape."""

import dataclasses

import pytest
import torch

from kvforge.core import QUANTIZER, ConfigError, KVCacheSpec, build_registry
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


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_cache_holds_over_3_5_times_the_float32_blocks_at_head_size_64(name):
    quantizer = build_registry().select(QUANTIZER, name).cls()
    float32 = KVCacheSpec(16, 4, 64, torch.float32, num_layers=2)
    quantized = dataclasses.replace(float32, quantizer=quantizer)
    budget = CacheConfig(memory_budget="64MiB", kv_cache_dtype=name)
    blocks = num_blocks_for(budget, quantized)
    assert blocks == 64 * 2**20 // quantized.bytes_per_block()
    # one byte per element plus a 4-byte scale per 64: 4 / (1 + 4/64) = 3.76x, less the 64-byte row padding
    assert blocks >= 3.5 * num_blocks_for(CacheConfig(memory_budget="64MiB"), float32)


def test_a_quantized_block_costs_its_data_and_its_scales():
    int8 = build_registry().select(QUANTIZER, "int8").cls()
    spec = KVCacheSpec(16, 4, 8, torch.float32, num_layers=2, quantizer=int8)
    data, scales = 2 * 16 * 4 * 8, 2 * 16 * 4 * 4  # int8 keys and values, float32 scales: 1024 + 512 bytes
    assert spec.bytes_per_block() == 2 * (data + scales)
    assert num_blocks_for(CacheConfig(memory_budget=10 * spec.bytes_per_block(), kv_cache_dtype="int8"), spec) == 10


def test_a_quantizer_name_needs_a_spec_that_carries_that_quantizer():
    with pytest.raises(ConfigError, match="names quantizer 'int8' but the KV cache spec has no quantizer"):
        num_blocks_for(CacheConfig(memory_budget="1MiB", kv_cache_dtype="int8"), SPEC)
    fp8 = dataclasses.replace(SPEC, quantizer=build_registry().select(QUANTIZER, "fp8_e4m3").cls())
    with pytest.raises(ConfigError, match="has quantizer 'fp8_e4m3'"):
        num_blocks_for(CacheConfig(memory_budget="1MiB", kv_cache_dtype="int8"), fp8)


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
