"""The scheduling mechanism, driven directly over a real KV cache manager and the
registered policies; the "model" is the step loop below (one token per sample)."""

from __future__ import annotations

import pytest
import torch

from kvforge import SamplingParams
from kvforge.core import BLOCK_ALLOCATOR, SCHEDULER_POLICY, build_registry
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import FinishReason, Request, RequestStatus
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.scheduler_output import SampledTokens, SamplerOutput, SchedulerOutput

REGISTRY = build_registry()


def make(num_blocks=8, block_size=4, policy="fcfs", max_num_seqs=8, budget=64, prefix_caching=False):
    allocator = REGISTRY.get(BLOCK_ALLOCATOR, "default").cls(num_blocks, block_size)
    kv = KVCacheManager(allocator, block_size, prefix_caching)
    return Scheduler(REGISTRY.get(SCHEDULER_POLICY, policy).cls(), kv, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget)


_arrivals = iter(range(10**9))


def request(name, prompt_len, priority=0, max_tokens=100, temperature=1.0) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=temperature),
                   priority=priority, arrival_index=next(_arrivals))


def samples_of(name, prompt_len, n) -> list[Request]:
    """The n samples of one prompt as the engine queues them: sample 0, with the others to fork from it."""
    params, arrival = SamplingParams(max_tokens=5, n=n), next(_arrivals)
    samples = [Request(name if i == 0 else f"{name}#{i}", list(range(1, prompt_len + 1)), params,
                       arrival_index=arrival, group_id=name, sample_index=i) for i in range(n)]
    samples[0].forks = samples[1:]
    return samples


def step(s: Scheduler) -> dict[str, int]:
    """Schedule once and apply the result like the engine: {request id: new tokens}."""
    out = s.schedule()
    s.update_from_output(out, SamplerOutput({e.request.request_id: SampledTokens([7]) for e in out.scheduled if e.samples}))
    return {e.request.request_id: e.num_tokens for e in out.scheduled}


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = make(num_blocks=16, budget=8)
    s.add(request("a", 20))
    assert [step(s) for _ in range(4)] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}]


def test_prefill_chunks_are_mixed_with_decodes_running_first():
    s = make(num_blocks=16, budget=6)
    s.add(request("a", 3))
    step(s)  # a prefilled, one token out
    s.add(request("b", 12))
    assert step(s) == {"a": 1, "b": 5}
    assert step(s) == {"a": 1, "b": 5}
    assert step(s) == {"a": 1, "b": 2}


def test_max_num_seqs_caps_running_requests():
    s = make(num_blocks=32, max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 2))
    assert set(step(s)) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_fcfs_preempts_the_latest_admitted_and_it_returns_to_its_place():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b, c = request("a", 4), request("b", 4), request("c", 8)
    for r in (a, b, c):
        s.add(r)
    step(s)  # a and b prefill (2 blocks); c needs 2 blocks and fits too: all 4 in use
    assert a.status is b.status is c.status is RequestStatus.RUNNING
    out = s.schedule()  # a needs a fifth block: c, admitted last, is the victim
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    s.add(request("d", 2))
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # before the later arrival


def test_fcfs_never_lets_a_later_request_overtake_the_head_of_the_queue():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(request("big", 4, max_tokens=30))
    step(s)
    s.add(request("huge", 20))  # needs 5 blocks: waits until "big" finishes
    s.add(request("small", 1))  # would fit now, but must not jump ahead
    for _ in range(5):
        assert "small" not in step(s)
    while s.running:
        step(s)
    assert s.waiting == [] or s.waiting[0].request_id == "small"


def test_priority_request_in_a_full_engine_preempts_and_runs_before_lower_ones():
    s = make(num_blocks=4, block_size=4, policy="priority")
    low1, low2 = request("low1", 6, priority=5), request("low2", 6, priority=3)
    s.add(low1)
    s.add(low2)
    step(s)  # the cache is full; both can still decode within their blocks
    s.add(request("mid", 4, priority=4))
    s.add(request("high", 4, priority=0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["low1"]  # lowest priority goes
    assert "high" in {e.request.request_id for e in out.scheduled}
    assert [r.request_id for r in s.waiting] == ["mid", "low1"]


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make(num_blocks=4, block_size=4, policy="fcfs")
    s.add(request("a", 14))
    step(s)  # 15 of 16 slots in use; a's next decode still fits
    s.add(request("b", 4, priority=-10))
    out = s.schedule()
    assert out.preempted == [] and [r.request_id for r in s.waiting] == ["b"]


def test_abort_frees_blocks_at_once():
    s = make(num_blocks=8)
    a = request("a", 10)
    s.add(a)
    step(s)
    assert s.kv.usage().in_use == 3
    s.finish(a, FinishReason.ABORT)
    assert s.kv.usage().in_use == 0 and a.finish_reason is FinishReason.ABORT and not s.has_unfinished()


def test_request_larger_than_the_whole_cache_ends_with_an_error_alone():
    s = make(num_blocks=2, block_size=4)
    s.add(big := request("big", 12))
    s.add(request("ok", 3))
    out = s.schedule()
    assert out.finished == [big] and big.finish_reason is FinishReason.ERROR and "KV cache" in big.error
    assert [e.request.request_id for e in out.scheduled] == ["ok"]


def test_running_request_outgrowing_the_whole_cache_stops_with_length():
    s = make(num_blocks=2, block_size=4)
    s.add(a := request("a", 7))
    step(s)
    step(s)  # 8 tokens: both blocks full
    out = s.schedule()  # needs a third block, nobody left to preempt
    assert out.finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert s.kv.usage().in_use == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_requests_are_recomputed_and_all_finish(policy):
    s = make(num_blocks=6, block_size=4, policy=policy, budget=16, prefix_caching=True)
    requests = [request(f"r{i}", 3 + 2 * i, priority=i % 3, max_tokens=6) for i in range(6)]
    for r in requests:
        s.add(r)
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
    assert all(r.finished and len(r.output_token_ids) == 6 for r in requests)
    assert s.num_preemptions > 0 and s.kv.usage().in_use == 0


def test_drafts_are_dropped_before_anyone_is_preempted_for_them():
    from kvforge.core import DraftProposal

    s = make(num_blocks=3, block_size=4)
    a, b = request("a", 7), request("b", 3)
    s.add(a)
    s.add(b)
    step(s)  # a: 8 known, 7 computed, 2 blocks; b: 1 block; the pool is full
    out = s.schedule({"a": DraftProposal([1, 2, 3, 4])})  # 5 more tokens for a would need a third block
    assert out.preempted == [] and {e.request.request_id: e.num_tokens for e in out.scheduled} == {"a": 1, "b": 1}
    assert out.scheduled[0].draft_token_ids == []


def test_drafts_cut_by_the_token_budget_keep_their_leading_tokens():
    from kvforge.core import DraftProposal

    s = make(num_blocks=8, block_size=4, budget=3)
    s.add(a := request("a", 2))
    step(s)
    [entry] = s.schedule({"a": DraftProposal([5, 6, 7, 8])}).scheduled
    assert entry.num_tokens == 3 and entry.draft_token_ids == [5, 6] and entry.samples
    # Verification accepted one draft: computed moves to 4 (last known + 1 draft), two tokens appended.
    s.update_from_output(SchedulerOutput(scheduled=[entry]), SamplerOutput({"a": SampledTokens([5, 9])}))
    assert a.output_token_ids == [7, 5, 9] and a.num_computed_tokens == 4 and s.kv.num_tokens("a") == 4


# The step's result: what the scheduler does with requests that sampled nothing


def test_non_finite_logits_end_only_that_request_and_change_nothing_else_of_it():
    s = make(num_blocks=8)
    s.add(a := request("a", 6))
    s.add(b := request("b", 3))
    step(s)  # both prefilled, one token out each
    update = s.update_from_output(s.schedule(), SamplerOutput({"b": SampledTokens([9])}, non_finite=["a"]))
    assert a.finish_reason is FinishReason.ERROR and a not in s.running and "a" not in s.kv
    assert "non-finite logits (NaN or infinity) for output token 1 of this request" in a.error
    assert "dtype = 'float32'" in a.error  # says what to try
    assert a.output_token_ids == [7] and a.num_computed_tokens == 6  # as before the step
    assert b.output_token_ids == [7, 9] and b.num_computed_tokens == 4
    assert update.failed == [a] and update.finished == [a] and update.progressed == [b]
    assert update.num_generated_tokens == 1


def test_a_nan_in_a_draft_row_sets_that_request_aside_and_the_others_are_sampled():
    from kvforge.core import DraftProposal
    from kvforge.engine.metrics import EngineMetrics
    from kvforge.engine.step_sampling import StepSampler

    s = make(num_blocks=8)
    s.add(a := request("a", 3, temperature=0))
    s.add(b := request("b", 3, temperature=0))
    step(s)
    plan = s.schedule({"b": DraftProposal([4, 5])})
    assert [e.num_logit_rows for e in plan.scheduled] == [1, 3]
    logits = torch.zeros(4, 16)
    logits[0, 11] = 5.0  # a's row
    logits[3, 2] = float("nan")  # b's last draft row
    output = StepSampler(0, EngineMetrics()).sample(plan, logits)
    assert output.non_finite == ["b"] and output.tokens == {"a": SampledTokens([11])}
    update = s.update_from_output(plan, output)
    assert a.output_token_ids == [7, 11] and b.output_token_ids == [7] and update.failed == [b]
    assert b.finish_reason is FinishReason.ERROR and s.running == [a]


def test_finite_logits_whose_sum_overflows_set_nothing_aside():
    from kvforge.engine.metrics import EngineMetrics
    from kvforge.engine.step_sampling import StepSampler

    s = make(num_blocks=8)
    s.add(request("a", 3, temperature=0))
    logits = torch.zeros(1, 16)
    logits[0, :4] = 3e38  # finite, but their float32 sum is infinite
    assert StepSampler(0, EngineMetrics()).sample(s.schedule(), logits).non_finite == []


def test_samples_waiting_to_fork_end_with_a_parent_whose_logits_are_non_finite():
    s = make(num_blocks=8)
    parent, *children = samples_of("p", 5, n=3)
    s.add(parent)
    plan = s.schedule()
    assert plan.scheduled[0].forks == children  # its prompt completes this step
    update = s.update_from_output(plan, SamplerOutput(non_finite=["p"]))
    assert parent.finish_reason is FinishReason.ERROR and update.finished == [parent]
    assert [(c.finish_reason, c.error) for c in children] == [(FinishReason.ERROR, parent.error)] * 2
    assert not any(c.forked or c.request_id in s.kv for c in children)
    assert not s.has_unfinished() and s.kv.usage().in_use == 0


@pytest.mark.parametrize("ending", ["larger than the cache", "outgrows the cache alone", "aborted"])
def test_samples_waiting_to_fork_end_as_their_parent_ends(ending):
    if ending == "larger than the cache":
        s = make(num_blocks=2, block_size=4)
        parent, child = samples_of("p", 12, n=2)
        s.add(parent)
        assert s.schedule().finished == [parent]
        expected = FinishReason.ERROR
    elif ending == "outgrows the cache alone":
        s = make(num_blocks=2, block_size=4, budget=4)  # prefilled in chunks of 4; the third needs a third block
        parent, child = samples_of("p", 12, n=2)
        s.add(parent)
        step(s)
        step(s)
        assert s.schedule().finished == [parent]
        expected = FinishReason.LENGTH
    else:
        s = make(num_blocks=8)
        parent, child = samples_of("p", 12, n=2)
        s.add(parent)
        s.finish(parent, FinishReason.ABORT)
        expected = FinishReason.ABORT
    assert parent.finish_reason is expected and parent.forks == []
    assert child.finished and (child.finish_reason, child.error) == (expected, parent.error)
    assert not child.forked and child not in s.running and child not in s.waiting
