"""Decode steps (with or without drafts to verify) build their inputs in buffers
kept across steps (`engine/decode_inputs.py`). Over runs of consecutive steps in
which requests grow past block boundaries, fork and copy a shared block, verify
drafts, finish and give their row to another request, and the batch shrinks and
grows, every step's tensors must equal those `ModelRunner.general_batch` builds
afresh for that step."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler_output import ScheduledRequest
from kvforge.plugins.block_allocators import NoCacheAllocator

BS = 4


def assert_same_inputs(fast, general):
    (ids, positions, batch), (ref_ids, ref_positions, ref) = fast, general
    pairs = [(ids, ref_ids), (positions, ref_positions), (batch.query_start_loc, ref.query_start_loc),
             (batch.seq_lens, ref.seq_lens), (batch.context_lens, ref.context_lens),
             (batch.block_table, ref.block_table), (batch.slot_mapping, ref.slot_mapping)]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
    assert (batch.block_size, batch.max_query_len, batch.max_seq_len) == (ref.block_size, ref.max_query_len,
                                                                          ref.max_seq_len)


class Decoding:
    """Requests decoding one token per step over a shared KV cache manager."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(NoCacheAllocator(4096, BS), BS, False)
        self.running: list[Request] = []
        self.count = 0

    def add(self, parent: Request | None = None) -> None:
        name = f"r{self.count}"
        self.count += 1
        if parent is None:
            request = Request(name, [self.rng.randrange(100) for _ in range(self.rng.randint(1, 20))],
                              SamplingParams(max_tokens=512))
            self.kv.admit(name, [])
            self.kv.allocate_slots(name, request.num_tokens - 1)
            request.num_computed_tokens = request.num_tokens - 1
        else:  # shares the parent's blocks: its first write into the last one copies it
            request = Request(name, list(parent.prompt_token_ids), parent.params)
            request.output_token_ids = list(parent.output_token_ids)
            self.kv.fork(parent.request_id, name)
            request.num_computed_tokens = parent.num_computed_tokens
        self.running.insert(self.rng.randrange(len(self.running) + 1), request)

    def plan(self, max_drafts: int = 0) -> list[ScheduledRequest]:
        """This step's entries, each request's blocks grown for its one new token and
        up to `max_drafts` draft tokens (a random count per request, often none)."""
        scheduled = []
        for request in self.running:
            drafts = [self.rng.randrange(100) for _ in range(self.rng.randint(0, max_drafts))]
            self.kv.allocate_slots(request.request_id, request.num_computed_tokens + 1 + len(drafts))
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, 1 + len(drafts), drafts))
        return scheduled

    def advance(self, churn: bool = True) -> None:
        for request in self.running:
            request.num_computed_tokens += 1
            request.output_token_ids.append(self.rng.randrange(100))
        if not churn:
            return
        if self.running and self.rng.random() < 0.15:  # one finishes; another takes its row
            done = self.running.pop(self.rng.randrange(len(self.running)))
            self.kv.free(done.request_id)
        if len(self.running) < 8 and self.rng.random() < 0.3:
            parent = self.rng.choice(self.running) if self.running and self.rng.random() < 0.5 else None
            self.add(parent)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), start=st.integers(1, 6), max_drafts=st.sampled_from([0, 0, 1, 4, 9]))
def test_decode_steps_match_fresh_tensors_step_after_step(seed, start, max_drafts):
    """Steps with and without drafts alternate (each request drafts a random count,
    often none), so buffers of either kind are reused after the other."""
    decoding = Decoding(seed)
    for _ in range(start):
        decoding.add()
    runner = ModelRunner(None, decoding.kv, [], BS, torch.device("cpu"))
    for _ in range(40):
        if not decoding.running:
            decoding.add()
        scheduled = decoding.plan(max_drafts)
        assert_same_inputs(runner.build_batch(scheduled), runner.general_batch(scheduled))
        decoding.advance()


def test_a_single_decode_crossing_block_boundaries_sees_each_new_block():
    """Batch 1, as one stream decodes: the table's row is rewritten as blocks are
    appended, and the new token's slot lands in the newest block."""
    decoding = Decoding(0)
    decoding.add()
    runner = ModelRunner(None, decoding.kv, [], BS, torch.device("cpu"))
    request = decoding.running[0]
    for _ in range(3 * BS + 1):
        scheduled = decoding.plan()
        ids, positions, batch = runner.build_batch(scheduled)
        table = decoding.kv.block_table(request.request_id)
        position = request.num_computed_tokens
        assert batch.block_table.tolist() == [table]
        assert batch.slot_mapping.tolist() == [table[position // BS] * BS + position % BS]
        assert positions.tolist() == [position] and ids.tolist() == [request.all_token_ids[position]]
        decoding.advance(churn=False)


def test_a_row_is_rewritten_when_its_block_grows_under_an_unchanged_width():
    """Two requests, the longer one fixing the table's width: the shorter one
    crossing a block boundary changes its row only, and that row must follow."""
    kv = KVCacheManager(NoCacheAllocator(64, BS), BS, False)
    long = Request("long", list(range(4 * BS)), SamplingParams())
    short = Request("short", [1], SamplingParams())
    for request in (long, short):
        kv.admit(request.request_id, [])
    kv.allocate_slots("long", 4 * BS)
    runner = ModelRunner(None, kv, [], BS, torch.device("cpu"))
    for position in range(2 * BS):
        short.output_token_ids = list(range(position))
        kv.allocate_slots("short", position + 1)
        scheduled = [ScheduledRequest(long, 4 * BS - 1, 1), ScheduledRequest(short, position, 1)]
        assert_same_inputs(runner.build_batch(scheduled), runner.general_batch(scheduled))


def test_the_general_path_takes_steps_that_prefill():
    kv = KVCacheManager(NoCacheAllocator(64, BS), BS, False)
    request = Request("a", list(range(9)), SamplingParams())
    kv.admit("a", [])
    kv.allocate_slots("a", 12)
    runner = ModelRunner(None, kv, [], BS, torch.device("cpu"))
    for entry in (ScheduledRequest(request, 0, 9), ScheduledRequest(request, 6, 3, [5])):  # 2 known + 1 draft
        ids, positions, batch = runner.build_batch([entry])
        assert ids.shape[0] == entry.num_tokens and batch.max_query_len == entry.num_tokens
    assert runner.decode_inputs._table_shape == (0, 0)  # never touched


def test_a_step_verifying_drafts_reads_each_draft_at_its_own_slot():
    """One request verifying 5 drafts across a block boundary, beside one without:
    the draft tokens follow the known one, positions and slots run on through the
    next block, and the query starts count each request's tokens."""
    kv = KVCacheManager(NoCacheAllocator(64, BS), BS, False)
    drafting, plain = Request("d", list(range(2 * BS)), SamplingParams()), Request("p", [7, 8], SamplingParams())
    for request, tokens in ((drafting, 2 * BS + 5), (plain, 2)):
        kv.admit(request.request_id, [])
        kv.allocate_slots(request.request_id, tokens)
    runner = ModelRunner(None, kv, [], BS, torch.device("cpu"))
    drafts = [50, 51, 52, 53, 54]
    scheduled = [ScheduledRequest(drafting, 2 * BS - 1, 6, drafts), ScheduledRequest(plain, 1, 1)]
    ids, positions, batch = runner.build_batch(scheduled)
    table = kv.block_table("d")
    assert ids.tolist() == [2 * BS - 1, *drafts, 8]
    assert positions.tolist() == [*range(2 * BS - 1, 2 * BS + 5), 1]
    assert batch.slot_mapping.tolist()[:6] == [table[p // BS] * BS + p % BS for p in range(2 * BS - 1, 2 * BS + 5)]
    assert batch.query_start_loc.tolist() == [0, 6, 7] and batch.max_query_len == 6
    assert_same_inputs((ids, positions, batch), runner.general_batch(scheduled))


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_buffers_grow_with_the_batch_and_keep_earlier_sizes_right(batch):
    decoding = Decoding(batch)
    runner = ModelRunner(None, decoding.kv, [], BS, torch.device("cpu"))
    for size in (batch, 1, batch + 9, 2):
        while len(decoding.running) < size:
            decoding.add()
        decoding.running = decoding.running[:size]
        scheduled = decoding.plan()
        assert_same_inputs(runner.build_batch(scheduled), runner.general_batch(scheduled))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.sampled_from([1, 2, 5]), steps=st.integers(2, 11))
def test_advancing_a_decode_step_gives_the_next_steps_inputs(seed, batch, steps):
    """A multi-step burst feeds each request the token the pass before sampled, one
    position on, with blocks reserved for every pass up front (engine/decode_bursts.py):
    each `advance` must equal the inputs built afresh for that step."""
    decoding = Decoding(seed)
    for _ in range(batch):
        decoding.add()
    for request in decoding.running:  # room for the whole burst, as Scheduler.reserve_steps makes
        decoding.kv.allocate_slots(request.request_id, request.num_computed_tokens + steps)
    runner = ModelRunner(None, decoding.kv, [], BS, torch.device("cpu"))
    scheduled = [ScheduledRequest(r, r.num_computed_tokens, 1) for r in decoding.running]
    runner.build_batch(scheduled)
    for _ in range(steps - 1):
        decoding.advance(churn=False)
        tokens = [request.output_token_ids[-1] for request in decoding.running]
        fresh = [ScheduledRequest(r, r.num_computed_tokens, 1) for r in decoding.running]
        assert_same_inputs(runner.decode_inputs.advance(tokens, torch.device("cpu")), runner.general_batch(fresh))


def test_advance_follows_a_plain_decode_step_only():
    kv = KVCacheManager(NoCacheAllocator(64, BS), BS, False)
    request = Request("a", list(range(3)), SamplingParams())
    kv.admit("a", [])
    kv.allocate_slots("a", 8)
    runner = ModelRunner(None, kv, [], BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="plain decode"):
        runner.decode_inputs.advance([1], torch.device("cpu"))
    runner.build_batch([ScheduledRequest(request, 2, 1)])
    with pytest.raises(ValueError, match="one token per request"):
        runner.decode_inputs.advance([1, 2], torch.device("cpu"))
    runner.build_batch([ScheduledRequest(request, 2, 3, [4, 5])])  # a step verifying drafts
    with pytest.raises(ValueError, match="plain decode"):
        runner.decode_inputs.advance([1], torch.device("cpu"))
