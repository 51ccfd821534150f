"""`ModelRunner.build_batch` and `logit_rows` against a per-token reference: the
step's tensors are built with a few batched ops (and none per token for pure
decodes), so every field is checked token by token on random ragged batches,
shuffled block tables, drafts and partly computed prompts."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.model_runner import ModelRunner, logit_rows
from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import ScheduledRequest
from kvforge.plugins.block_allocators import NoCacheAllocator

BS = 4


def reference(scheduled, kv):
    """Everything per token, in plain Python."""
    tokens, positions, slots, qsl = [], [], [], [0]
    for entry in scheduled:
        request = entry.request
        known = request.prompt_token_ids + request.output_token_ids + entry.draft_token_ids
        table = kv.block_table(request.request_id)
        for p in range(entry.start, entry.start + entry.num_tokens):
            tokens.append(known[p])
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + entry.num_tokens)
    width = max(len(kv.block_table(e.request.request_id)) for e in scheduled)
    table = [kv.block_table(e.request.request_id) + [0] * (width - len(kv.block_table(e.request.request_id)))
             for e in scheduled]
    return tokens, positions, slots, qsl, table


def build(seed: int, num_requests: int, decode_only: bool):
    rng = random.Random(seed)
    kv = KVCacheManager(NoCacheAllocator(512, BS), BS, False)
    # Take blocks in a shuffled order, so physical ids bear no relation to positions.
    filler = [f"f{i}" for i in range(8)]
    for name in filler:
        kv.admit(name, [])
        kv.allocate_slots(name, rng.randint(1, 12))
    scheduled = []
    for i in range(num_requests):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 30))]
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=64))
        request.output_token_ids = [rng.randrange(100) for _ in range(rng.randint(0, 10))]
        drafts = [] if decode_only or rng.random() < 0.5 else [rng.randrange(100) for _ in range(rng.randint(1, 3))]
        total = len(prompt) + len(request.output_token_ids)
        if decode_only or drafts:
            start = total - 1
        else:
            start = rng.randint(0, total - 1)
        num = (total - start if not decode_only and not drafts else 1) + len(drafts)
        if not decode_only and not drafts and rng.random() < 0.3:
            num = rng.randint(1, total - start)  # a prompt chunk that does not reach the end: no logits
        kv.admit(request.request_id, [])
        kv.allocate_slots(request.request_id, start + num + rng.randint(0, 9))  # room ahead, as the scheduler leaves
        scheduled.append(ScheduledRequest(request, start, num, drafts))
        if filler and rng.random() < 0.3:
            kv.free(filler.pop())
    return scheduled, kv


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_requests=st.integers(1, 9), decode_only=st.booleans())
def test_build_batch_matches_a_per_token_reference(seed, num_requests, decode_only):
    scheduled, kv = build(seed, num_requests, decode_only)
    runner = ModelRunner(None, kv, [], BS, torch.device("cpu"))
    input_ids, positions, batch = runner.build_batch(scheduled)
    tokens, ref_positions, slots, qsl, table = reference(scheduled, kv)
    assert input_ids.dtype == torch.int64 and input_ids.tolist() == tokens
    assert positions.dtype == torch.int64 and positions.tolist() == ref_positions
    assert batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.tolist() == slots
    assert batch.query_start_loc.dtype == torch.int32 and batch.query_start_loc.tolist() == qsl
    assert batch.block_table.dtype == torch.int32 and batch.block_table.tolist() == table
    assert batch.context_lens.dtype == torch.int32
    assert batch.context_lens.tolist() == [e.start for e in scheduled]
    assert batch.seq_lens.dtype == torch.int32
    assert batch.seq_lens.tolist() == [e.start + e.num_tokens for e in scheduled]
    assert batch.max_query_len == max(e.num_tokens for e in scheduled)
    assert batch.max_seq_len == max(e.start + e.num_tokens for e in scheduled)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_requests=st.integers(1, 9), decode_only=st.booleans())
def test_logit_rows_are_each_sampling_entrys_last_tokens(seed, num_requests, decode_only):
    scheduled, _ = build(seed, num_requests, decode_only)
    expected, row = [], 0
    for entry in scheduled:
        row += entry.num_tokens
        if entry.samples:  # the last known token and every draft
            expected += list(range(row - 1 - len(entry.draft_token_ids), row))
    assert logit_rows(scheduled) == expected
    assert decode_only is False or expected == list(range(len(scheduled)))


def test_live_block_tables_names_a_missing_request():
    kv = KVCacheManager(NoCacheAllocator(8, BS), BS, False)
    kv.admit("a", [])
    with pytest.raises(Exception, match="'b'"):
        kv.live_block_tables(["a", "b"])


class RecordingModel:
    """A model that records whether each call of a step ran in inference mode."""

    vocab_size = 5

    def __init__(self):
        self.modes: dict[str, bool] = {}

    def plan(self, batch, output_rows=None):
        self.modes["plan"] = torch.is_inference_mode_enabled()

    def forward(self, input_ids, positions, kv_caches, plan):
        self.modes["forward"] = torch.is_inference_mode_enabled()
        return torch.zeros(input_ids.shape[0], 3)

    def compute_logits(self, hidden):
        self.modes["compute_logits"] = torch.is_inference_mode_enabled()
        return torch.zeros(hidden.shape[0], self.vocab_size)


@pytest.mark.parametrize("decode_only", [True, False])
def test_a_step_runs_the_model_in_inference_mode_and_leaves_it_after(decode_only):
    scheduled, kv = build(3, 4, decode_only)
    model = RecordingModel()
    logits = ModelRunner(model, kv, [], BS, torch.device("cpu")).execute(scheduled)
    assert model.modes == {"plan": True, "forward": True, "compute_logits": True}
    assert logits.is_inference() and logits.shape == (len(logit_rows(scheduled)), model.vocab_size)
    assert not torch.is_inference_mode_enabled()
