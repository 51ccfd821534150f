"""The allocator checks added for guarantees 7, 8, 11 and 12 can fail: each planted
allocator (tests/planted/block_allocators.py; three of them the bugs a planted-bug run
slipped past the suite) is caught by the check written for the guarantee it breaks,
and the built-in `default` passes the same checks."""

import pytest

from kvforge.conformance import check_block_allocator_prefix_caching as check_prefix
from kvforge.conformance import check_block_allocator_reset as check_reset
from kvforge.conformance.pool_machine import run_pool_machine
from kvforge.core import BlockAllocator, BlockStateError
from kvforge.plugins.block_allocators import NoCacheAllocator, PrefixCachingAllocator
from kvforge.plugins.block_pool import BlockPool
from tests.planted.block_allocators import (
    CountsOnlyHits,
    EvictsCachedFirst,
    IgnoresSeed,
    RandomRoot,
    ResetKeepsIndex,
    ResetLeavesQueue,
    ResetsWhileHeld,
)


def make_pool(cls):
    return lambda num_blocks=8, **options: cls(num_blocks, check_prefix.BLOCK_SIZE, **options)


def reset_pool(cls):
    return cls(check_reset.NUM_BLOCKS, check_reset.BLOCK_SIZE)


class CachesWithoutReset(PrefixCachingAllocator):
    """A caching allocator written for API 1.1: no reset_prefix_cache of its own."""

    name = "caches-without-reset"
    reset_prefix_cache = BlockAllocator.reset_prefix_cache


# Guarantee 8: hit accounting

def test_lookup_counting_check_catches_counting_only_hits():
    check_prefix.test_lookup_counts_every_hash_asked_for_and_every_block_found(make_pool(PrefixCachingAllocator))
    with pytest.raises(AssertionError, match="guarantee 8"):
        check_prefix.test_lookup_counts_every_hash_asked_for_and_every_block_found(make_pool(CountsOnlyHits))
    with pytest.raises(Exception, match="guarantee 8"):  # hypothesis may group several failures
        run_pool_machine(CountsOnlyHits, max_examples=60)


# Guarantee 11: never-cached blocks first

def test_eviction_order_check_catches_evicting_cached_blocks_first():
    for count in range(9):
        check_prefix.test_never_cached_free_blocks_are_used_before_any_cached_block_is_evicted(
            make_pool(PrefixCachingAllocator), count)
    caught = []
    for count in range(9):
        try:
            check_prefix.test_never_cached_free_blocks_are_used_before_any_cached_block_is_evicted(
                make_pool(EvictsCachedFirst), count)
        except AssertionError as exc:
            assert "guarantee 11" in str(exc)
            caught.append(count)
    assert caught == [1, 2, 3, 4, 5, 6, 7]  # 0 evicts nothing, and 8 must evict all three anyway
    with pytest.raises(Exception, match="guarantee 11"):
        run_pool_machine(EvictsCachedFirst, max_examples=60)


# Guarantee 7: equal hashes across instances with one seed

def test_cross_instance_hash_check_catches_a_random_root():
    check_prefix.test_two_allocators_with_one_seed_hash_alike_and_other_seeds_differently(
        make_pool(PrefixCachingAllocator))
    with pytest.raises(AssertionError, match="same hash_seed hash the same tokens differently"):
        check_prefix.test_two_allocators_with_one_seed_hash_alike_and_other_seeds_differently(make_pool(RandomRoot))


def test_cross_instance_hash_check_catches_an_ignored_seed():
    with pytest.raises(AssertionError, match="hash_seed 0 and 1 give equal hashes"):
        check_prefix.test_two_allocators_with_one_seed_hash_alike_and_other_seeds_differently(make_pool(IgnoresSeed))


# Guarantee 12: reset_prefix_cache

@pytest.mark.parametrize("cls", [PrefixCachingAllocator, NoCacheAllocator], ids=lambda c: c.name)
def test_the_builtins_pass_the_reset_checks(cls):
    check_reset.test_reset_is_refused_while_a_block_is_held_and_changes_nothing(reset_pool(cls))
    check_reset.test_reset_once_all_are_free_clears_every_hash(reset_pool(cls))
    check_reset.test_reset_of_an_empty_pool_clears_nothing(reset_pool(cls))


def test_reset_check_catches_a_reset_while_blocks_are_held():
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_reset.test_reset_is_refused_while_a_block_is_held_and_changes_nothing(reset_pool(ResetsWhileHeld))
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):  # the machine's own pytest.raises
        run_pool_machine(ResetsWhileHeld, max_examples=60)


def test_reset_check_catches_a_reset_that_keeps_the_hash_index():
    with pytest.raises(AssertionError, match="lookup still finds blocks after a reset"):
        check_reset.test_reset_once_all_are_free_clears_every_hash(reset_pool(ResetKeepsIndex))


def test_reset_check_catches_a_reset_that_leaves_blocks_in_the_cached_queue():
    with pytest.raises(AssertionError):
        check_reset.test_reset_once_all_are_free_clears_every_hash(reset_pool(ResetLeavesQueue))
    with pytest.raises(Exception):
        run_pool_machine(ResetLeavesQueue, max_examples=60)


def test_a_caching_allocator_written_before_reset_is_skipped_and_refuses_resets():
    assert check_reset.lacks_reset(CachesWithoutReset)
    assert not check_reset.lacks_reset(PrefixCachingAllocator) and not check_reset.lacks_reset(NoCacheAllocator)
    run_pool_machine(CachesWithoutReset, max_examples=5)  # its machine has no reset rule to trip over
    pool = CachesWithoutReset(4, 2)
    with pytest.raises(NotImplementedError, match="'caches-without-reset' does not implement reset_prefix_cache"):
        pool.reset_prefix_cache()


def test_the_default_reset_of_an_allocator_without_caching_refuses_while_held():
    class Plain(BlockPool):
        name = "plain"

    assert Plain.reset_prefix_cache is BlockAllocator.reset_prefix_cache
    pool = Plain(4, 2)
    held = pool.allocate(1)
    with pytest.raises(BlockStateError, match="'plain': 1 of 4 blocks are held"):
        pool.reset_prefix_cache()
    pool.free(held)
    assert pool.reset_prefix_cache() == 0
