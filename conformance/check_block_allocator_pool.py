"""Conformance of every `block_allocator`: guarantees 1-5 and 10 of
`kvforge.core.block_allocator.BlockAllocator` (the pool), checked by example and
by random sequences of allocate / free / fork / write / cache / lookup / acquire /
reset, which also check lookup counting (8), eviction order (11) and resets (12)."""

import pytest

from kvforge.conformance.pool_snapshot import BLOCK_SIZE, NUM_BLOCKS, snapshot
from kvforge.conformance.selection import quick
from kvforge.core import BLOCK_ALLOCATOR, BlockStateError, OutOfBlocksError

KIND = BLOCK_ALLOCATOR
GROUP = "pool"
HEAVY = True  # runs after its kind's light groups: a broken implementation fails those in seconds


@pytest.fixture
def pool(registration):
    return registration.cls(NUM_BLOCKS, BLOCK_SIZE)


def test_allocate_returns_distinct_fresh_blocks_with_one_reference(pool):
    blocks = pool.allocate(5)
    assert len(blocks) == len(set(blocks)) == 5
    assert all(0 <= b < NUM_BLOCKS and pool.ref_count(b) == 1 and pool.block_hash_of(b) is None for b in blocks)
    assert pool.usage().in_use == 5 and pool.usage().free == NUM_BLOCKS - 5


def test_allocation_that_cannot_be_satisfied_raises_and_changes_nothing(pool):
    held = pool.allocate(NUM_BLOCKS - 2)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3)
    assert snapshot(pool) == before
    assert len(set(held + pool.allocate(2))) == NUM_BLOCKS


def test_never_hands_out_a_held_block(pool):
    first = pool.allocate(4)
    pool.free(first[:2])
    second = pool.allocate(NUM_BLOCKS - 2)
    assert not set(first[2:]) & set(second)


@pytest.mark.parametrize("bad", ["double free", "never allocated", "out of range", "negative"])
def test_freeing_a_block_nobody_holds_raises_naming_it_and_changes_nothing(pool, bad):
    held = pool.allocate(3)
    if bad == "double free":
        pool.free([held[2]])
        block = held[2]
    else:
        block = {"never allocated": next(b for b in range(NUM_BLOCKS) if b not in held),
                 "out of range": NUM_BLOCKS, "negative": -1}[bad]
    before = snapshot(pool)
    with pytest.raises(BlockStateError, match=rf"(?<!\d){block}(?!\d)"):
        pool.free([held[0], block])
    assert snapshot(pool) == before


def test_freeing_a_block_twice_in_one_call_beyond_its_holders_changes_nothing(pool):
    (block,) = pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(BlockStateError):
        pool.free([block, block])
    assert snapshot(pool) == before


def test_forking_an_unheld_block_raises_and_changes_nothing(pool):
    held = pool.allocate(2)
    pool.free([held[1]])
    before = snapshot(pool)
    with pytest.raises(BlockStateError, match=str(held[1])):
        pool.fork(held)
    assert snapshot(pool) == before


def test_fork_adds_one_reference_to_each_block(pool):
    blocks = pool.allocate(3)
    assert list(pool.fork(blocks)) == blocks
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2]
    pool.free(blocks)
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1] and pool.usage().in_use == 3


def test_copy_on_write_keeps_a_block_with_one_holder(pool):
    (block,) = pool.allocate(1)
    assert pool.copy_on_write(block) == block and pool.ref_count(block) == 1


def test_copy_on_write_gives_a_sharer_its_own_fresh_block(pool):
    (block,) = pool.allocate(1)
    pool.fork([block])
    copy = pool.copy_on_write(block)
    assert copy != block
    assert pool.ref_count(copy) == 1 and pool.ref_count(block) == 1 and pool.block_hash_of(copy) is None
    assert pool.copy_on_write(block) == block  # the other holder is now alone


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing(pool):
    blocks = pool.allocate(NUM_BLOCKS)
    pool.fork(blocks[:1])
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError):
        pool.copy_on_write(blocks[0])
    assert snapshot(pool) == before


def test_pool_is_fully_free_once_every_holder_releases(pool):
    blocks = pool.allocate(5)
    shared = pool.fork(blocks[:3])
    copy = pool.copy_on_write(blocks[0])
    pool.free(blocks)
    pool.free([copy, *shared[1:]])
    assert pool.usage().free == NUM_BLOCKS and pool.usage().in_use == 0


def test_random_operations_keep_the_pool_consistent(registration):
    from kvforge.conformance.pool_machine import run_pool_machine

    run_pool_machine(registration.cls, max_examples=15 if quick() else 60)
