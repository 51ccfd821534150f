"""The KV cache manager: block tables, slot mappings, copy-on-write forks and
prefix-cache admission over a block allocator."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvforge.core import BlockStateError, RequestError, paged_csr
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.plugins.block_allocators import NoCacheAllocator, PrefixCachingAllocator

BS = 4


def manager(num_blocks=16, caching=True):
    cls = PrefixCachingAllocator if caching else NoCacheAllocator
    return KVCacheManager(cls(num_blocks, BS), BS, caching)


def run(kv, request_id, tokens, extra_keys=()):
    """Admit and compute a whole sequence in one step; returns the hit length."""
    computed = kv.admit(request_id, tokens, extra_keys)
    assert kv.allocate_slots(request_id, len(tokens))
    kv.cache_blocks(request_id, tokens, len(tokens))
    return computed


# Block tables and slots

def test_slot_mapping_follows_the_block_table():
    kv = manager()
    kv.admit("a", [])
    kv.allocate_slots("a", 10)
    table = kv.block_table("a")
    slots = kv.slot_mapping("a", 2, 10)
    expected = [table[p // BS] * BS + p % BS for p in range(2, 10)]
    assert slots.dtype == torch.int64 and slots.tolist() == expected


def test_slot_mapping_refuses_positions_without_room():
    kv = manager()
    kv.admit("a", [])
    kv.allocate_slots("a", 5)
    with pytest.raises(RequestError, match=r"request 'a'.*\[0, 8\)"):
        kv.slot_mapping("a", 6, 9)


def test_tables_grow_by_whole_blocks_only_when_needed():
    kv = manager()
    kv.admit("a", [])
    assert kv.allocate_slots("a", 1) and len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 4) and len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 5) and len(kv.block_table("a")) == 2
    assert kv.usage().in_use == 2


def test_allocation_that_does_not_fit_returns_false_and_changes_nothing():
    kv = manager(num_blocks=3)
    kv.admit("a", [])
    kv.allocate_slots("a", 8)
    assert not kv.can_allocate("a", 13)
    assert not kv.allocate_slots("a", 13)
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == 1
    assert kv.can_allocate("a", 12) and kv.allocate_slots("a", 12)


def test_block_table_tensor_is_int32_padded_with_zero():
    kv = manager()
    for request_id, length in (("a", 9), ("b", 2)):
        kv.admit(request_id, [])
        kv.allocate_slots(request_id, length)
    table = kv.block_table_tensor(["a", "b"])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == kv.block_table("a") and table[1].tolist() == kv.block_table("b") + [0, 0]


def test_csr_view_equals_the_dense_table():
    kv = manager()
    lengths = {"a": 9, "b": 2, "c": 12}
    for request_id, length in lengths.items():
        kv.admit(request_id, [])
        kv.allocate_slots(request_id, length)
    csr = kv.csr(list(lengths), list(lengths.values()))
    expected = paged_csr(kv.block_table_tensor(list(lengths)), torch.tensor(list(lengths.values())), BS)
    assert csr.indptr.tolist() == expected.indptr.tolist() == [0, 3, 4, 7]
    assert csr.indices.tolist() == kv.block_table("a") + kv.block_table("b") + kv.block_table("c")
    assert csr.last_page_len.tolist() == [1, 2, 4]


# Copy-on-write forks

def test_fork_shares_every_block():
    kv = manager()
    run(kv, "a", list(range(6)))
    kv.fork("a", "b")
    assert kv.block_table("b") == kv.block_table("a")
    assert all(kv.allocator.ref_count(b) == 2 for b in kv.block_table("a"))


def test_first_write_after_fork_copies_the_shared_partial_block_once():
    kv = manager()
    run(kv, "a", list(range(6)))
    kv.fork("a", "b")
    shared_full, shared_partial = kv.block_table("a")
    assert kv.allocate_slots("b", 7)
    copies = kv.pop_pending_copies()
    assert copies == [(shared_partial, kv.block_table("b")[1])]
    assert kv.block_table("b")[0] == shared_full and kv.block_table("b")[1] != shared_partial
    assert kv.allocate_slots("a", 7) and kv.pop_pending_copies() == []  # "a" is alone in its block now
    assert kv.block_table("a") == [shared_full, shared_partial]


def test_fork_at_a_block_boundary_copies_nothing():
    kv = manager()
    run(kv, "a", list(range(8)))
    kv.fork("a", "b")
    assert kv.allocate_slots("b", 9) and kv.allocate_slots("a", 9)
    assert kv.pop_pending_copies() == []
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2] and kv.block_table("a")[2] != kv.block_table("b")[2]


def test_freeing_a_request_drops_its_pending_copies():
    kv = manager()
    run(kv, "a", list(range(6)))
    kv.fork("a", "b")
    kv.allocate_slots("b", 7)
    kv.free("b")  # preempted in the same step
    assert kv.pop_pending_copies() == []


def test_a_copy_counts_as_a_needed_block():
    kv = manager(num_blocks=2)
    run(kv, "a", list(range(6)))
    kv.fork("a", "b")
    assert not kv.can_allocate("b", 7) and not kv.allocate_slots("b", 7)
    assert kv.pop_pending_copies() == [] and kv.block_table("b") == kv.block_table("a")


# Prefix caching

def test_prefix_hit_shares_the_cached_blocks():
    kv = manager()
    prompt = list(range(13))
    run(kv, "a", prompt)
    assert kv.admit("b", prompt) == 12
    assert kv.block_table("b") == kv.block_table("a")[:3]
    assert all(kv.allocator.ref_count(b) == 2 for b in kv.block_table("b"))


def test_prefix_hit_never_covers_the_whole_prompt():
    kv = manager()
    prompt = list(range(8))
    run(kv, "a", prompt)
    assert kv.admit("b", prompt) == 4  # the last token is recomputed for its logits
    assert kv.allocate_slots("b", 8) and kv.pop_pending_copies() == []


def test_only_full_blocks_are_cached():
    kv = manager()
    run(kv, "a", list(range(7)))
    assert kv.usage().cached == 0
    kv.free("a")
    assert kv.usage().cached == 1
    assert kv.admit("b", list(range(7)) + [99]) == 4


def test_different_extra_keys_do_not_share_blocks():
    kv = manager()
    run(kv, "a", list(range(9)), ("tenant-a",))
    assert kv.admit("b", list(range(9)), ("tenant-b",)) == 0
    assert kv.admit("c", list(range(9)), ("tenant-a",)) == 8


def test_a_readmitted_request_hits_its_own_freed_blocks():
    kv = manager()
    tokens = list(range(11))
    run(kv, "a", tokens)
    kv.free("a")
    assert kv.admit("a", tokens) == 8


def test_freeing_a_request_evicts_its_tail_first():
    kv = manager(num_blocks=3)
    tokens = list(range(12))
    run(kv, "a", tokens)
    kv.free("a")
    kv.admit("b", [])
    kv.allocate_slots("b", 1)  # evicts one block: the tail
    assert kv.admit("c", tokens + [0]) == 8


def test_with_prefix_caching_off_nothing_hits():
    for kv in (manager(caching=False), KVCacheManager(PrefixCachingAllocator(16, BS), BS, False)):
        run(kv, "a", list(range(9)))
        kv.free("a")
        assert kv.admit("b", list(range(9))) == 0 and kv.usage().cached == 0


def test_a_block_computed_twice_is_cached_once():
    kv = manager()
    run(kv, "a", list(range(8)))
    run(kv, "b", list(range(8)))  # hits the first block, recomputes the second
    kv.free("a")
    kv.free("b")
    assert kv.usage().cached == 2


# Bad input

def test_forking_a_finished_request_raises_naming_it():
    kv = manager()
    run(kv, "a", list(range(5)))
    kv.free("a")
    with pytest.raises(RequestError, match="cannot fork request 'a'"):
        kv.fork("a", "b")
    assert "b" not in kv and kv.usage().in_use == 0


def test_admitting_twice_and_freeing_unknown_requests_raise():
    kv = manager()
    kv.admit("a", [1])
    with pytest.raises(RequestError, match="'a': it is already admitted"):
        kv.admit("a", [1])
    with pytest.raises(RequestError, match="cannot free request 'zz'"):
        kv.free("zz")


def test_a_broken_table_is_reported_with_the_block_and_the_request():
    kv = manager()
    run(kv, "a", list(range(5)))
    table = kv.block_table("a")
    kv.allocator.free(table[-1:])  # someone released "a"'s block behind the manager's back
    with pytest.raises(BlockStateError, match=f"request 'a'.*block {table[-1]}"):
        kv.free("a")
    assert kv.allocator.ref_count(table[0]) == 1, "a failed free must leave the pool unchanged"


def test_more_computed_tokens_than_room_is_refused():
    kv = manager()
    kv.admit("a", [])
    kv.allocate_slots("a", 3)
    with pytest.raises(RequestError, match="call allocate_slots first"):
        kv.cache_blocks("a", list(range(5)), 5)


def test_block_sizes_must_agree():
    with pytest.raises(RequestError, match="block size 8 differs"):
        KVCacheManager(NoCacheAllocator(4, 16), 8, False)


# End to end: a simulated cache holds token ids instead of keys and values

class CacheMachine(RuleBasedStateMachine):
    """Random admissions, decode steps, forks and frees, with every copy and write
    applied to a cache tensor; each request must always read back its own tokens."""

    def __init__(self):
        super().__init__()
        self.kv = manager(num_blocks=12)
        self.cache = torch.full((12, BS), -1, dtype=torch.int64)
        self.tokens: dict[str, list[int]] = {}
        self.count = 0

    def _step(self, request_id, tokens, start):
        if not self.kv.allocate_slots(request_id, len(tokens)):
            return False
        for src, dst in self.kv.pop_pending_copies():
            self.cache[dst] = self.cache[src]
        self.cache.view(-1)[self.kv.slot_mapping(request_id, start, len(tokens))] = torch.tensor(tokens[start:])
        self.kv.cache_blocks(request_id, tokens, len(tokens))
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens):
        request_id, self.count = f"r{self.count}", self.count + 1
        computed = self.kv.admit(request_id, tokens)
        assert computed < len(tokens) and computed % BS == 0
        if computed:
            assert self.cache.view(-1)[self.kv.slot_mapping(request_id, 0, computed)].tolist() == tokens[:computed]
        if self._step(request_id, tokens, computed):
            self.tokens[request_id] = tokens
        else:
            self.kv.free(request_id)

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 2))
    def decode(self, pick, token):
        request_id = sorted(self.tokens)[pick % len(self.tokens)]
        tokens = self.tokens[request_id] + [token]
        if self._step(request_id, tokens, len(tokens) - 1):
            self.tokens[request_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = sorted(self.tokens)[pick % len(self.tokens)]
        child, self.count = f"r{self.count}", self.count + 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 99))
    def free(self, pick):
        request_id = sorted(self.tokens)[pick % len(self.tokens)]
        self.kv.free(request_id)
        del self.tokens[request_id]

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for request_id, tokens in self.tokens.items():
            assert self.cache.view(-1)[self.kv.slot_mapping(request_id, 0, len(tokens))].tolist() == tokens

    def teardown(self):
        for request_id in self.tokens:
            self.kv.free(request_id)
        assert self.kv.usage().in_use == 0


def test_random_requests_always_read_back_their_own_tokens():
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


# Rolling back rejected draft tokens

def test_truncate_frees_blocks_wholly_past_the_kept_tokens():
    kv = manager()
    kv.admit("a", [1] * 5)
    assert kv.allocate_slots("a", 14)  # 5 known + 9 drafts: 4 blocks
    before = kv.num_free_blocks
    kv.truncate("a", 6)  # 6 kept: blocks 0 and 1 stay, 2 and 3 go back
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == before + 2
    assert kv.num_tokens("a") == 6 and kv.capacity("a") == 8
    kv.truncate("a", 8)  # nothing past a block boundary: no change
    assert len(kv.block_table("a")) == 2


def test_truncate_never_gives_back_cached_blocks():
    kv = manager()
    run(kv, "a", list(range(9)))  # two full blocks cached
    with pytest.raises(RequestError, match="prefix cache"):
        kv.truncate("a", 7)
