"""The random-operations model behind `check_block_allocator_pool` (kept apart so
that listing the check modules does not import hypothesis before pytest starts)."""

import os

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvforge.core import BlockStateError, OutOfBlocksError

from .attention_cases import SEED_ENV
from .check_block_allocator_reset import lacks_reset
from .pool_snapshot import BLOCK_SIZE, NUM_BLOCKS, snapshot


class PoolMachine(RuleBasedStateMachine):
    """Random operations against a model of who holds what; `cls` is set per implementation."""

    cls = None

    def __init__(self):
        super().__init__()
        self.pool = self.cls(NUM_BLOCKS, BLOCK_SIZE)
        self.caching = self.cls.supports_prefix_caching
        self.holders: list[list[int]] = []
        self.refs = [0] * NUM_BLOCKS
        self.hash_of: dict[int, bytes] = {}  # block -> the hash the model says it carries
        self.block_of: dict[bytes, int] = {}
        self.lookups = self.hits = 0  # what usage() must report (guarantee 8)
        # A caching allocator written for API 1.0/1.1 may lack reset_prefix_cache (guarantee 12).
        self.resets = not lacks_reset(self.cls)

    def _forget_hash(self, block):
        if block in self.hash_of:
            del self.block_of[self.hash_of.pop(block)]

    def _holder(self, pick):
        return self.holders[pick % len(self.holders)]

    @rule(count=st.integers(1, 2) | st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, count):
        if count > self.refs.count(0):
            before = snapshot(self.pool)
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(count)
            assert snapshot(self.pool) == before
            return
        never_cached = sum(1 for b, r in enumerate(self.refs) if not r and b not in self.hash_of)
        blocks = self.pool.allocate(count)
        self.holders.append(blocks)  # before the checks, so teardown frees them and a failure here is the one reported
        assert len(blocks) == len(set(blocks)) == count
        evicted = sum(1 for b in blocks if b in self.hash_of)
        assert evicted == max(0, count - never_cached), \
            f"allocate({count}) evicted {evicted} cached blocks with {never_cached} never-cached ones free " \
            f"(guarantee 11)"
        for block in blocks:
            assert self.refs[block] == 0, f"allocate handed out block {block}, which is held"
            assert self.pool.block_hash_of(block) is None
            self.refs[block] = 1
            self._forget_hash(block)

    @precondition(lambda self: self.holders)
    @rule(pick=st.integers(0, 99))
    def free(self, pick):
        blocks = self.holders.pop(pick % len(self.holders))
        self.pool.free(blocks)
        for block in blocks:
            self.refs[block] -= 1

    @precondition(lambda self: self.holders)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        blocks = self.pool.fork(self._holder(pick))
        for block in blocks:
            self.refs[block] += 1
        self.holders.append(list(blocks))

    @precondition(lambda self: any(self.holders))
    @rule(pick=st.integers(0, 99), position=st.integers(0, 99))
    def write(self, pick, position):
        holder = self._holder(pick) if self._holder(pick) else next(h for h in self.holders if h)
        index = position % len(holder)
        block = holder[index]
        if self.refs[block] > 1 and 0 not in self.refs:
            before = snapshot(self.pool)
            with pytest.raises(OutOfBlocksError):
                self.pool.copy_on_write(block)
            assert snapshot(self.pool) == before
            return
        copy = self.pool.copy_on_write(block)
        if self.refs[block] == 1:
            assert copy == block
            return
        assert self.refs[copy] == 0, f"copy_on_write handed out block {copy}, which is held"
        assert self.pool.block_hash_of(copy) is None
        self.refs[block] -= 1
        self.refs[copy] = 1
        self._forget_hash(copy)
        holder[index] = copy

    @precondition(lambda self: self.caching and any(self.holders))
    @rule(pick=st.integers(0, 99), position=st.integers(0, 99), token=st.integers(0, 3))
    def cache(self, pick, position, token):
        holder = self._holder(pick) if self._holder(pick) else next(h for h in self.holders if h)
        block = holder[position % len(holder)]
        if block in self.hash_of:
            return
        block_hash = self.pool.hash_block(None, [token] * BLOCK_SIZE)
        stored = self.pool.cache_block(block, block_hash)
        assert stored == (block_hash not in self.block_of)
        if stored:
            self.hash_of[block] = block_hash
            self.block_of[block_hash] = block

    @precondition(lambda self: self.caching)
    @rule(tokens=st.lists(st.integers(0, 3), max_size=3), take=st.booleans())
    def lookup(self, tokens, take):
        hashes = [self.pool.hash_block(None, [t] * BLOCK_SIZE) for t in tokens]
        expected = []
        for block_hash in hashes:
            if block_hash not in self.block_of:
                break
            expected.append(self.block_of[block_hash])
        before = snapshot(self.pool)
        assert list(self.pool.lookup(hashes)) == expected
        self.lookups += len(hashes)
        self.hits += len(expected)
        assert snapshot(self.pool) == before, "lookup took references"
        if take and expected:
            self.pool.acquire(expected)
            for block in expected:
                self.refs[block] += 1
            self.holders.append(expected)

    @precondition(lambda self: self.resets)
    @rule()
    def reset_prefix_cache(self):
        if any(self.refs):
            before = snapshot(self.pool)
            with pytest.raises(BlockStateError):
                self.pool.reset_prefix_cache()
            assert snapshot(self.pool) == before, "a refused reset_prefix_cache changed the pool"
            return
        assert self.pool.reset_prefix_cache() == len(self.hash_of)
        self.hash_of.clear()
        self.block_of.clear()

    @rule(block=st.sampled_from([-1, NUM_BLOCKS, NUM_BLOCKS + 5, *range(NUM_BLOCKS)]))
    def free_unheld(self, block):
        if 0 <= block < NUM_BLOCKS and self.refs[block]:
            return
        before = snapshot(self.pool)
        with pytest.raises(BlockStateError):
            self.pool.free([block])
        assert snapshot(self.pool) == before

    @invariant()
    def matches_model(self):
        assert [self.pool.ref_count(b) for b in range(NUM_BLOCKS)] == self.refs
        usage = self.pool.usage()
        in_use = sum(1 for r in self.refs if r)
        assert (usage.in_use, usage.free) == (in_use, NUM_BLOCKS - in_use)
        assert (usage.lookups, usage.hits) == (self.lookups, self.hits), "lookup miscounts (guarantee 8)"
        if self.caching:
            assert usage.cached == sum(1 for b in self.hash_of if not self.refs[b])
            assert all(self.pool.block_hash_of(b) == h for b, h in self.hash_of.items())

    def teardown(self):
        for blocks in self.holders:
            self.pool.free(blocks)
        assert self.pool.usage().free == NUM_BLOCKS
        assert all(self.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))


def run_pool_machine(cls, max_examples: int) -> None:
    """Run random operation sequences against `cls`; raises on the first broken guarantee.

    First the derandomized sequences, the same in every run, so that what one run
    catches every run catches; then, when the run pins a seed (`kvforge conformance`
    always does, and prints it), as many sequences drawn from that seed, which
    explore further from run to run and which `--seed` replays."""
    machine = type(f"{cls.__name__}PoolMachine", (PoolMachine,), {"cls": cls})
    run_state_machine_as_test(machine, settings=_settings(max_examples, derandomize=True))
    pinned = os.environ.get(SEED_ENV, "").strip()
    if pinned:
        run_state_machine_as_test(seed(int(pinned))(machine), settings=_settings(max_examples, derandomize=False))


def _settings(max_examples: int, derandomize: bool) -> settings:
    return settings(max_examples=max_examples, stateful_step_count=30, deadline=None, database=None,
                    derandomize=derandomize, suppress_health_check=list(HealthCheck))
