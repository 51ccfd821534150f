"""Conformance of every `block_allocator` that declares `supports_prefix_caching`:
guarantees 7-11 of `kvforge.core.block_allocator.BlockAllocator` (hash chains,
equal across instances with one seed; lookup and its hit accounting; LRU
eviction with tails first; cleared hashes on reuse; never-cached blocks used
before any cached one is evicted)."""

import pytest

from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.pool_snapshot import BLOCK_SIZE, NUM_BLOCKS
from kvforge.core import BLOCK_ALLOCATOR

KIND = BLOCK_ALLOCATOR
GROUP = "prefix caching"


@pytest.fixture
def make_pool(registration):
    if not registration.cls.supports_prefix_caching:
        not_applicable(f"{registration.name} does not declare prefix caching")
    return lambda num_blocks=NUM_BLOCKS, **options: registration.cls(num_blocks, BLOCK_SIZE, **options)


def chain(pool, token_ids, extra_keys=()):
    """The chained hashes of the full blocks of `token_ids`."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = pool.hash_block(parent, token_ids[start:start + BLOCK_SIZE], extra_keys)
        hashes.append(parent)
    return hashes


def cached_sequence(pool, token_ids, extra_keys=()):
    """Allocate and cache one block per full block of `token_ids`; returns (blocks, hashes)."""
    hashes = chain(pool, token_ids, extra_keys)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        assert pool.cache_block(block, block_hash)
    return blocks, hashes


def test_hash_depends_on_parent_tokens_and_extra_keys(make_pool):
    pool = make_pool()
    tokens = [1, 2, 3, 4]
    base = pool.hash_block(None, tokens)
    assert pool.hash_block(None, tokens) == base
    variants = [pool.hash_block(base, tokens), pool.hash_block(None, [1, 2, 3, 5]),
                pool.hash_block(None, tokens, ("salt",)), pool.hash_block(None, tokens, ("model-b",)),
                pool.hash_block(pool.hash_block(None, [9, 9, 9, 9]), tokens)]
    assert len({base, *variants}) == len(variants) + 1


def test_two_allocators_with_one_seed_hash_alike_and_other_seeds_differently(make_pool):
    tokens, keys = list(range(12)), ("salt",)
    first = chain(make_pool(), tokens, keys)
    assert chain(make_pool(), tokens, keys) == first, \
        "two allocators with the same hash_seed hash the same tokens differently (guarantee 7)"
    assert chain(make_pool(hash_seed=7), tokens, keys) == chain(make_pool(hash_seed=7), tokens, keys)
    other = chain(make_pool(hash_seed=1), tokens, keys)
    assert not set(other) & set(first), "hash_seed 0 and 1 give equal hashes (guarantee 7)"


def test_lookup_counts_every_hash_asked_for_and_every_block_found(make_pool):
    pool = make_pool()
    _, hashes = cached_sequence(pool, list(range(8)))
    before = pool.usage()
    missing = chain(pool, [99] * BLOCK_SIZE)
    pool.lookup(hashes + chain(pool, list(range(12)))[2:])  # 3 asked, 2 found
    pool.lookup(missing)  # 1 asked, 0 found
    pool.lookup([])
    usage = pool.usage()
    assert (usage.lookups - before.lookups, usage.hits - before.hits) == (4, 2), \
        f"lookup must count every block asked for and every block found (guarantee 8); got " \
        f"{usage.lookups - before.lookups} asked and {usage.hits - before.hits} found for 4 and 2"


def test_equal_prefixes_share_blocks(make_pool):
    pool = make_pool()
    blocks, hashes = cached_sequence(pool, list(range(12)))
    found = pool.lookup(hashes)
    assert list(found) == blocks
    pool.acquire(found)
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2]


def test_lookup_returns_the_longest_cached_prefix_and_takes_no_reference(make_pool):
    pool = make_pool()
    blocks, hashes = cached_sequence(pool, list(range(12)))
    other = chain(pool, [0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99])
    assert list(pool.lookup(other)) == blocks[:2]
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    usage = pool.usage()
    assert usage.lookups >= usage.hits >= 2


def test_same_tokens_after_a_different_prefix_do_not_hit(make_pool):
    pool = make_pool()
    cached_sequence(pool, [1, 1, 1, 1, 5, 6, 7, 8])
    assert list(pool.lookup(chain(pool, [2, 2, 2, 2, 5, 6, 7, 8]))) == []
    assert pool.lookup(chain(pool, [2, 2, 2, 2, 5, 6, 7, 8])[1:]) == []


def test_different_cache_salts_never_hit_each_other(make_pool):
    pool = make_pool()
    tokens = list(range(8))
    cached_sequence(pool, tokens, ("tenant-a",))
    assert list(pool.lookup(chain(pool, tokens, ("tenant-b",)))) == []
    assert list(pool.lookup(chain(pool, tokens))) == []
    assert len(pool.lookup(chain(pool, tokens, ("tenant-a",)))) == 2


def test_a_hash_is_carried_by_one_block_only(make_pool):
    pool = make_pool()
    blocks, hashes = cached_sequence(pool, list(range(4)))
    (other,) = pool.allocate(1)
    assert pool.cache_block(other, hashes[0]) is False
    assert pool.block_hash_of(other) is None and list(pool.lookup(hashes)) == blocks


def test_freed_cached_blocks_stay_cached_until_evicted(make_pool):
    pool = make_pool()
    blocks, hashes = cached_sequence(pool, list(range(12)))
    pool.free(blocks)
    usage = pool.usage()
    assert usage.free == 8 and usage.cached == 3
    found = pool.lookup(hashes)
    assert list(found) == blocks
    pool.acquire(found)
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1] and pool.usage().cached == 0


def _fill_with_cached(pool, num_blocks):
    """Cache one single-block sequence per block and free them in order; returns their blocks."""
    blocks = []
    for token in range(num_blocks):
        (block,), _ = cached_sequence(pool, [token] * BLOCK_SIZE)
        blocks.append(block)
    return blocks


def test_eviction_takes_the_tail_of_a_freed_sequence_first(make_pool):
    pool = make_pool(4)
    blocks, hashes = cached_sequence(pool, list(range(16)))
    pool.free(blocks)
    assert pool.allocate(1) == [blocks[3]]
    assert pool.allocate(1) == [blocks[2]]
    assert list(pool.lookup(hashes)) == blocks[:2]


def test_eviction_is_least_recently_used_first(make_pool):
    pool = make_pool(4)
    first, first_hashes = cached_sequence(pool, [1] * 8)
    second, second_hashes = cached_sequence(pool, [2] * 8)
    pool.free(first)
    pool.free(second)
    assert sorted(pool.allocate(2)) == sorted(first)
    assert list(pool.lookup(second_hashes)) == second


def test_a_cached_block_hit_again_becomes_most_recently_used(make_pool):
    pool = make_pool(4)
    first, first_hashes = cached_sequence(pool, [1] * 8)
    second, second_hashes = cached_sequence(pool, [2] * 8)
    pool.free(first)
    pool.free(second)
    found = pool.lookup(first_hashes)
    pool.acquire(found)
    pool.free(found)
    assert sorted(pool.allocate(2)) == sorted(second)
    assert list(pool.lookup(first_hashes)) == first


def test_a_reused_block_loses_its_hash(make_pool):
    pool = make_pool(2)
    blocks, hashes = cached_sequence(pool, list(range(8)))
    pool.free(blocks)
    reused = pool.allocate(2)
    assert sorted(reused) == sorted(blocks)
    assert all(pool.block_hash_of(b) is None for b in reused)
    assert list(pool.lookup(hashes)) == [] and pool.usage().cached == 0


@pytest.mark.parametrize("count", range(9))
def test_never_cached_free_blocks_are_used_before_any_cached_block_is_evicted(make_pool, count):
    pool = make_pool(8)
    cached, hashes = cached_sequence(pool, list(range(12)))
    plain = pool.allocate(2)
    pool.free(cached)
    pool.free(plain)  # freed after the cached ones: an LRU over all free blocks would evict those first
    never_cached = 8 - len(cached)
    pool.allocate(count)
    evicted = sum(pool.block_hash_of(b) is None for b in cached)
    assert evicted == max(0, count - never_cached), \
        f"allocate({count}) evicted {evicted} cached blocks while {never_cached} never-cached blocks were free " \
        f"(guarantee 11: evict only when none is left)"
