"""The built-in block allocators `default` and `nocache`: what they do beyond the
interface (the shared guarantees are checked by kvforge.conformance)."""

import importlib.util

import pytest
import torch

from kvforge.conformance import check_block_allocator_pool as check_pool
from kvforge.conformance import check_block_allocator_prefix_caching as check_prefix
from kvforge.conformance import check_block_allocator_scaling as check_scaling
from kvforge.conformance.pool_machine import run_pool_machine
from kvforge.core import (
    BLOCK_ALLOCATOR,
    BlockStateError,
    ConfigError,
    Registration,
    SelectionRequest,
    build_registry,
)
from kvforge.plugins.block_allocators import NoCacheAllocator, PrefixCachingAllocator
from kvforge.plugins.block_hashing import available_algorithms
from kvforge.plugins.block_pool import Block, FreeQueue
from tests.planted.block_allocators import ForgetfulCopy, HeadFirst, ScanningAllocate

HAS_XXHASH = importlib.util.find_spec("xxhash") is not None


def cache_one(pool, token):
    (block,) = pool.allocate(1)
    block_hash = pool.hash_block(None, [token] * pool.block_size)
    assert pool.cache_block(block, block_hash)
    return block, block_hash


# Registration and selection

def test_both_register_through_the_block_allocators_entry_point():
    registry = build_registry(environ={})
    for name in ("default", "nocache"):
        registration = registry.get(BLOCK_ALLOCATOR, name)
        assert registration.plugin == "block-allocators" and registration.distribution == "kvforge"


def test_auto_selects_the_prefix_caching_default():
    registry = build_registry(environ={})
    assert registry.select(BLOCK_ALLOCATOR, "auto", SelectionRequest(prefix_caching=True)).cls is PrefixCachingAllocator
    assert registry.select(BLOCK_ALLOCATOR, "auto").cls is PrefixCachingAllocator


def test_nocache_refuses_prefix_caching_with_a_reason_and_serves_without_it():
    registry = build_registry(environ={})
    assert NoCacheAllocator.unsupported_reasons(SelectionRequest(prefix_caching=True)) == ["does not support prefix caching"]
    assert registry.select(BLOCK_ALLOCATOR, "nocache", SelectionRequest(prefix_caching=None)).cls is NoCacheAllocator


def test_nocache_keeps_no_hashes():
    pool = NoCacheAllocator(4, 2)
    assert pool.lookup([b"x"]) == [] and pool.cache_block(0, b"x") is False
    with pytest.raises(NotImplementedError, match="nocache"):
        pool.hash_block(None, [1, 2])


# Free lists

def test_free_queue_unlinks_any_block_and_keeps_order():
    blocks = [Block(i) for i in range(5)]
    queue = FreeQueue(blocks)
    queue.remove(blocks[2])
    assert queue.ids() == [0, 1, 3, 4] and queue.size == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert queue.ids() == [1, 3, 4, 2] and blocks[0].prev is None


def test_uncached_free_blocks_are_used_before_cached_ones():
    pool = PrefixCachingAllocator(4, 2)
    cached, block_hash = cache_one(pool, 7)
    plain = pool.allocate(1)
    pool.free([cached])
    pool.free(plain)
    assert cached not in pool.allocate(3)
    assert pool.lookup([block_hash]) == [cached]
    assert pool.allocate(1) == [cached] and pool.lookup([block_hash]) == []


def test_a_freed_sequence_without_hashes_goes_back_to_the_plain_free_list():
    pool = PrefixCachingAllocator(3, 2)
    pool.free(pool.allocate(3))
    assert pool.usage().cached == 0 and pool.free_queue.size == 3


# Hashing

def test_sha256_is_the_default_hash():
    pool = PrefixCachingAllocator(2, 2)
    assert pool.hash_algorithm == "sha256" and len(pool.hash_block(None, [1, 2])) == 32
    assert "sha256" in PrefixCachingAllocator.capabilities()["hash_algorithms"]


def test_unknown_hash_algorithm_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'md5' is unknown; valid choices: sha256, xxhash"):
        PrefixCachingAllocator(2, 2, hash_algorithm="md5")


@pytest.mark.skipif(HAS_XXHASH, reason="xxhash is installed here")
def test_xxhash_is_reported_unavailable_when_not_installed():
    assert "xxhash" not in available_algorithms()
    with pytest.raises(ConfigError, match="unavailable.*pip install xxhash"):
        PrefixCachingAllocator(2, 2, hash_algorithm="xxhash")


@pytest.mark.skipif(not HAS_XXHASH, reason="xxhash is not installed")
def test_xxhash_chains_like_sha256():
    pool = PrefixCachingAllocator(2, 2, hash_algorithm="xxhash")
    first = pool.hash_block(None, [1, 2])
    assert len(first) == 16 and pool.hash_block(first, [1, 2]) != first


def test_the_seed_changes_every_hash():
    tokens = [3, 4]
    assert PrefixCachingAllocator(2, 2, hash_seed=0).hash_block(None, tokens) != \
        PrefixCachingAllocator(2, 2, hash_seed=1).hash_block(None, tokens)
    assert PrefixCachingAllocator(2, 2, hash_seed=5).hash_block(None, tokens) == \
        PrefixCachingAllocator(2, 2, hash_seed=5).hash_block(None, tokens)


def test_tokens_as_list_or_tensor_hash_alike_and_key_types_stay_apart():
    pool = PrefixCachingAllocator(2, 2)
    assert pool.hash_block(None, [5, 6]) == pool.hash_block(None, torch.tensor([5, 6]))
    keyed = {pool.hash_block(None, [5, 6], (key,)) for key in (1, "1", b"1", (1,))}
    assert len(keyed) == 4


def test_hit_rate_counts_blocks_asked_for_and_found():
    pool = PrefixCachingAllocator(4, 2)
    _, block_hash = cache_one(pool, 1)
    pool.lookup([block_hash, b"missing"])
    pool.lookup([b"missing"])
    usage = pool.usage()
    assert (usage.lookups, usage.hits, usage.hit_rate) == (3, 1, pytest.approx(1 / 3))


# Bad input

def test_out_of_range_error_names_the_block_and_the_valid_range():
    pool = NoCacheAllocator(4, 2)
    with pytest.raises(BlockStateError, match=r"block 9: out of range; valid block ids are 0\.\.3"):
        pool.ref_count(9)


def test_acquiring_a_block_without_hash_raises_and_changes_nothing():
    pool = PrefixCachingAllocator(4, 2)
    cached, _ = cache_one(pool, 1)
    pool.free([cached])
    (plain,) = pool.allocate(1)
    with pytest.raises(BlockStateError, match=f"block {plain}: it carries no hash"):
        pool.acquire([cached, plain])
    assert pool.ref_count(cached) == 0 and pool.usage().cached == 1


def test_caching_a_free_block_raises():
    pool = PrefixCachingAllocator(4, 2)
    with pytest.raises(BlockStateError, match="block 2: nobody holds it"):
        pool.cache_block(2, b"h")


def test_recaching_a_block_under_another_hash_raises_and_same_hash_is_accepted():
    pool = PrefixCachingAllocator(4, 2)
    block, block_hash = cache_one(pool, 1)
    assert pool.cache_block(block, block_hash)
    with pytest.raises(BlockStateError, match=f"block {block} under a new hash"):
        pool.cache_block(block, pool.hash_block(None, [9, 9]))


def test_a_pool_needs_at_least_one_block():
    with pytest.raises(BlockStateError, match="num_blocks >= 1"):
        NoCacheAllocator(0, 16)


def test_negative_allocation_count_is_refused():
    with pytest.raises(BlockStateError, match="-1"):
        NoCacheAllocator(2, 2).allocate(-1)


# Bad input, for each built-in

@pytest.mark.parametrize("cls", [PrefixCachingAllocator, NoCacheAllocator], ids=lambda c: c.name)
@pytest.mark.parametrize("bad", ["double free", "never allocated", "out of range"])
def test_bad_frees_name_the_block_and_leave_the_pool_unchanged(cls, bad):
    pool = cls(4, 2)
    held = pool.allocate(2)
    if bad == "double free":
        pool.free(held[1:])
    block = {"double free": held[1], "never allocated": 3, "out of range": 4}[bad]
    before = ([pool.ref_count(b) for b in range(4)], pool.usage())
    with pytest.raises(BlockStateError, match=f"block {block}"):
        pool.free([held[0], block])
    assert ([pool.ref_count(b) for b in range(4)], pool.usage()) == before
    assert pool.allocate(pool.usage().free) and pool.usage().free == 0  # still consistent


# The conformance checks can fail: each planted allocator is caught by the check for its guarantee

def registration(cls) -> Registration:
    return Registration(BLOCK_ALLOCATOR, cls.name, cls, "test", "test", "0", (1, 0))


def test_pool_check_catches_a_copy_that_keeps_the_shared_reference():
    with pytest.raises(AssertionError):
        check_pool.test_copy_on_write_gives_a_sharer_its_own_fresh_block(ForgetfulCopy(8, 4))
    with pytest.raises(Exception):  # hypothesis may group several failures
        run_pool_machine(ForgetfulCopy, max_examples=60)


def test_prefix_caching_check_catches_head_first_eviction():
    with pytest.raises(AssertionError):
        check_prefix.test_eviction_takes_the_tail_of_a_freed_sequence_first(lambda n=8: HeadFirst(n, check_prefix.BLOCK_SIZE))


def test_scaling_check_catches_a_scan(monkeypatch):
    monkeypatch.setattr(check_scaling, "LARGE", 50_000)
    monkeypatch.setattr(check_scaling, "REPEATS", 3)
    with pytest.raises(AssertionError, match="O\\(1\\) per block"):
        check_scaling.test_cost_per_block_does_not_grow_with_the_pool(
            registration(ScanningAllocate), check_scaling.mostly_held, check_scaling.allocate_fork_free)
