"""Conformance of every `block_allocator`: guarantee 12 of
`kvforge.core.block_allocator.BlockAllocator` — `reset_prefix_cache()` is refused
while any block is held and, once all are free, leaves no hash behind.

Allocators without prefix caching have nothing to clear and must still refuse
while held. A prefix-caching allocator written before the method existed
inherits the interface's default, which refuses every reset; it is skipped with
that reason rather than failed, since API 1.1 did not ask for the method.
"""

import pytest

from kvforge.conformance.pool_snapshot import BLOCK_SIZE, NUM_BLOCKS, snapshot
from kvforge.core import BLOCK_ALLOCATOR, BlockAllocator, BlockStateError

KIND = BLOCK_ALLOCATOR
GROUP = "reset"


def lacks_reset(cls) -> bool:
    """Whether `cls` caches but keeps the interface's refusing `reset_prefix_cache`."""
    return cls.supports_prefix_caching and cls.reset_prefix_cache is BlockAllocator.reset_prefix_cache


@pytest.fixture
def pool(registration):
    cls = registration.cls
    if lacks_reset(cls):
        pytest.skip(f"{registration.name} caches but does not implement reset_prefix_cache (optional for plugins "
                    f"written for API 1.0/1.1); a reset is refused with it")
    return cls(NUM_BLOCKS, BLOCK_SIZE)


def state(pool) -> tuple:
    """Everything observable about the pool, the lookup counters included."""
    usage = pool.usage()
    return snapshot(pool), usage.lookups, usage.hits


def fill(pool) -> tuple[list[int], list[int], list[bytes]]:
    """Cache a 3-block sequence (freed) and hold 2 blocks, one of them cached too.
    Returns (freed cached blocks, held blocks, every hash cached)."""
    if not pool.supports_prefix_caching:
        return [], pool.allocate(2), []
    hashes, parent = [], None
    for token in range(4):
        parent = pool.hash_block(parent, [token] * BLOCK_SIZE)
        hashes.append(parent)
    freed = pool.allocate(3)
    held = pool.allocate(2)
    for block, block_hash in zip(freed + held[:1], hashes):
        assert pool.cache_block(block, block_hash)
    pool.free(freed)
    pool.lookup(hashes)  # so the counters are not zero
    return freed, held, hashes


def test_reset_is_refused_while_a_block_is_held_and_changes_nothing(pool):
    _, held, _ = fill(pool)
    for holding in (held, held[1:]):  # a cached held block, then an uncached one
        before = state(pool)
        with pytest.raises(BlockStateError, match="held"):
            pool.reset_prefix_cache()
        assert state(pool) == before, "a refused reset_prefix_cache changed the pool (guarantee 12)"
        pool.free(holding[:1])


def test_reset_once_all_are_free_clears_every_hash(pool):
    _, held, hashes = fill(pool)
    pool.free(held)
    counters = (pool.usage().lookups, pool.usage().hits)
    assert pool.reset_prefix_cache() == len(hashes)
    usage = pool.usage()
    assert all(pool.block_hash_of(b) is None for b in range(NUM_BLOCKS)), "a block kept its hash after a reset"
    assert (usage.free, usage.cached, usage.in_use) == (NUM_BLOCKS, 0, 0)
    assert (usage.lookups, usage.hits) == counters, "a reset changed the lifetime lookup counters"
    if pool.supports_prefix_caching:
        assert list(pool.lookup(hashes)) == [], "lookup still finds blocks after a reset"
        blocks = pool.allocate(NUM_BLOCKS)  # every block is usable, none evicted twice
        assert sorted(blocks) == list(range(NUM_BLOCKS))
        for block, block_hash in zip(blocks, hashes):
            assert pool.cache_block(block, block_hash), "the same content cannot be cached again after a reset"
        assert list(pool.lookup(hashes)) == blocks[:len(hashes)]


def test_reset_of_an_empty_pool_clears_nothing(pool):
    assert pool.reset_prefix_cache() == 0
    assert pool.usage().free == NUM_BLOCKS
