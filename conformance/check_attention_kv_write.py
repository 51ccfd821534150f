"""Conformance of every `attention_backend`'s cache write (guarantee 2 of
`kvforge.core.AttentionBackend`): each key and value lands exactly at its slot,
-1 slots are skipped, and no other element of the cache changes."""

import random

import pytest
import torch

from kvforge.core import ATTENTION_BACKEND, NHD, KVCacheSpec
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
    expected = before.clone()
    scatter(expected, keys, values, slots)
    cache = before.to(tgt.device)
    backend.write_kv(keys.to(tgt.device), values.to(tgt.device), cache, slots.to(tgt.device))
    cache = cache.cpu()
    if torch.equal(cache, expected):
        return None
    wrong = (cache != expected).nonzero()
    return (f"block_size={block_size} head_size={head_size} dtype={dtype} {tokens} tokens ({skipped} with slot -1) "
            f"seed={seed}: {len(wrong)} cache elements differ, first at [block, k/v, offset, head, dim]="
            f"{wrong[0].tolist()}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_puts_each_token_exactly_at_its_slot_and_nowhere_else(registration, dtype):
    tgt = target(registration)
    if tgt.cls.kv_layout != NHD:
        not_applicable(f"{tgt.name} uses layout {tgt.cls.kv_layout}; this check reads the NHD layout")
    if dtype not in tgt.cls.dtypes:
        not_applicable(f"{tgt.name} does not declare {dtype}")
    seed = fresh_seed()
    problems = [write_once(tgt, dtype, block_size, head_size, seed + i, skipped=0)
                for i, (block_size, head_size) in enumerate(zip(tgt.block_sizes(), tgt.head_sizes() * 4))]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


@pytest.mark.parametrize("skipped", [1, 5])
def test_write_skips_slots_marked_minus_one(registration, skipped):
    tgt = target(registration)
    if tgt.cls.kv_layout != NHD:
        not_applicable(f"{tgt.name} uses layout {tgt.cls.kv_layout}; this check reads the NHD layout")
    dtype = tgt.dtypes()[0]
    seed = fresh_seed()
    problems = [write_once(tgt, dtype, block_size, tgt.head_sizes()[0], seed + i, skipped=skipped)
                for i, block_size in enumerate(tgt.block_sizes())]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
