"""Conformance of every `attention_backend`'s cache write (guarantee 2 of
`kvforge.core.AttentionBackend`): each key and value lands exactly at its slot,
-1 slots are skipped, and no other element of the cache changes. The cache is
read through the backend's `kv_views`, so a backend with its own layout is
checked the same way as one with the NHD layout."""

import random

import pytest
import torch

from kvforge.core import ATTENTION_BACKEND, KVCacheSpec
from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import DTYPES, fresh_seed, make_layer, scatter, target
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)

KIND = ATTENTION_BACKEND
GROUP = "kv write"
pytestmark = pytest.mark.usefixtures("one_thread")


def write_once(tgt, dtype: torch.dtype, block_size: int, head_size: int, seed: int, skipped: int) -> str | None:
    layer = make_layer(head_size, 4)
    spec = KVCacheSpec(block_size, layer.num_kv_heads, head_size, dtype)
    backend = tgt.cls(layer, spec, tgt.device)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = random.Random(seed).randint(3, 9)
    total = num_blocks * block_size
    tokens = random.Random(seed + 1).randint(1, total)
    slots = torch.randperm(total, generator=gen)[:tokens]  # distinct slots, any order
    slots[torch.randperm(tokens, generator=gen)[:skipped]] = -1
    shape = (tokens, layer.num_kv_heads, head_size)
    keys, values = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    before = torch.randn(type(backend).kv_cache_shape(num_blocks, spec), generator=gen).to(dtype)
    expected = nhd(backend, before).clone()
    scatter(expected, keys, values, slots)
    cache = before.to(tgt.device)
    backend.write_kv(keys.to(tgt.device), values.to(tgt.device), cache, slots.to(tgt.device))
    found = nhd(backend, cache.cpu())
    if torch.equal(found, expected):
        return None
    wrong = (found != expected).nonzero()
    return (f"block_size={block_size} head_size={head_size} dtype={dtype} {tokens} tokens ({skipped} with slot -1) "
            f"seed={seed}: {len(wrong)} cache elements differ, first at [block, k/v, offset, head, dim]="
            f"{wrong[0].tolist()}")


def nhd(backend, cache: torch.Tensor) -> torch.Tensor:
    """Every element of `cache`, read through the backend's `kv_views`, as one NHD
    tensor `[num_blocks, 2, block_size, num_kv_heads, head_size]`."""
    keys, values = backend.kv_views(cache)
    read = torch.stack([keys, values], dim=1)
    if read.numel() != cache.numel():
        raise AssertionError(f"{type(backend).__name__}.kv_views covers {read.numel()} of the cache's "
                             f"{cache.numel()} elements")
    return read


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_puts_each_token_exactly_at_its_slot_and_nowhere_else(registration, dtype):
    tgt = target(registration)
    if dtype not in tgt.cls.dtypes:
        not_applicable(f"{tgt.name} does not declare {dtype}")
    seed = fresh_seed()
    problems = [write_once(tgt, dtype, block_size, head_size, seed + i, skipped=0)
                for i, (block_size, head_size) in enumerate(zip(tgt.block_sizes(), tgt.head_sizes() * 4))]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


@pytest.mark.parametrize("skipped", [1, 5])
def test_write_skips_slots_marked_minus_one(registration, skipped):
    tgt = target(registration)
    dtype = tgt.dtypes()[0]
    seed = fresh_seed()
    problems = [write_once(tgt, dtype, block_size, tgt.head_sizes()[0], seed + i, skipped=skipped)
                for i, block_size in enumerate(tgt.block_sizes())]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
