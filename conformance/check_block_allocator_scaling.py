"""Conformance of every `block_allocator`: guarantee 6 of
`kvforge.core.block_allocator.BlockAllocator` — allocate, free, fork, acquire and
lookup cost O(1) per block, whatever the pool size.

The same batch of operations is timed on a pool of 10^3 blocks and on one of
10^6 (10^5 in quick mode), with the pool mostly free, mostly held, and (with
prefix caching) mostly cached, so a scan over free, held or cached blocks is
1000x (100x) slower on the large pool. The bound is 5x, the best of several
interleaved repeats with the garbage collector paused, so a busy machine does
not make it flaky.
"""

import gc
import time

import pytest

from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.selection import quick
from kvforge.core import BLOCK_ALLOCATOR

KIND = BLOCK_ALLOCATOR
GROUP = "scaling"
HEAVY = True  # runs after its kind's light groups: a broken implementation fails those in seconds

SMALL = 1_000
LARGE = 100_000 if quick() else 1_000_000
BATCH = 64
ROUNDS = 20
REPEATS = 7
BOUND = 5.0


def allocate_fork_free(pool, _):
    for _ in range(ROUNDS):
        blocks = pool.allocate(BATCH)
        pool.fork(blocks)
        pool.free(blocks)
        pool.free(blocks)


def lookup_acquire_free(pool, hashes):
    for _ in range(ROUNDS):
        blocks = pool.lookup(hashes)
        pool.acquire(blocks)
        pool.free(blocks)
        pool.free(pool.allocate(BATCH))  # evicts when nothing uncached is free


def mostly_free(cls, num_blocks):
    return cls(num_blocks, 16), None


def mostly_held(cls, num_blocks):
    pool = cls(num_blocks, 16)
    pool.allocate(num_blocks - 2 * BATCH)
    return pool, None


def mostly_cached(cls, num_blocks):
    """Every block cached and free; the batch looked up sits in the middle of the LRU order."""
    pool = cls(num_blocks, 16)
    blocks = pool.allocate(num_blocks)
    for block in blocks:
        pool.cache_block(block, b"scaling-%d" % block)
    pool.free(blocks)
    middle = num_blocks // 2
    return pool, [b"scaling-%d" % b for b in blocks[middle:middle + BATCH]]


def best_time(pool, operation, argument) -> float:
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        operation(pool, argument)
        return time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()


@pytest.mark.parametrize("layout, operation", [
    (mostly_free, allocate_fork_free),
    (mostly_held, allocate_fork_free),
    (mostly_cached, lookup_acquire_free),
], ids=["mostly free", "mostly held", "mostly cached"])
def test_cost_per_block_does_not_grow_with_the_pool(registration, layout, operation):
    if layout is mostly_cached and not registration.cls.supports_prefix_caching:
        not_applicable(f"{registration.name} does not declare prefix caching")
    small, small_arg = layout(registration.cls, SMALL)
    large, large_arg = layout(registration.cls, LARGE)
    times = {"small": [], "large": []}
    for _ in range(REPEATS):  # interleaved, so a burst of load hits both sizes
        times["small"].append(best_time(small, operation, small_arg))
        times["large"].append(best_time(large, operation, large_arg))
    ratio = min(times["large"]) / min(times["small"])
    assert ratio < BOUND, (f"{registration.name}: the same operations cost {ratio:.1f}x as much on {LARGE} blocks "
                           f"as on {SMALL}; they must cost O(1) per block whatever the pool size")
