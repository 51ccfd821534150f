"""A step whose every entry samples one plain row (no drafts, forks, grammar,
penalties, bias, logprobs or `min_tokens` to reach) skips the batch machinery
(`step_sampling.plain_requests`, `Sampler.draw`). Over runs of steps on random
batches, plain and not, it must emit exactly the tokens and logprobs the general
path does, and leave every random stream (the engine's and each seeded
request's) where the general path leaves it: on CPU with kvforge's C++ library
(one `greedy_rows` call checks finiteness and finds the greedy tokens) and
without it (numpy)."""

import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import SamplingParams
from kvforge.engine.metrics import EngineMetrics
from kvforge.engine.request import Request
from kvforge.engine.scheduler_output import SamplerOutput, ScheduledRequest, SchedulerOutput
from kvforge.engine import step_sampling
from kvforge.engine.step_sampling import StepSampler, plain_requests, split_non_finite
from kvforge.kernels import build

VOCAB = 96
KINDS = {
    "greedy": dict(temperature=0.0),
    "greedy seeded": dict(temperature=0.0, seed=5),
    "seeded": dict(temperature=1.0, seed=11),
    "seeded hot": dict(temperature=1.7, seed=3),
    "unseeded": dict(temperature=0.8),
    "top-k top-p": dict(temperature=1.0, top_k=9, top_p=0.8, seed=2),
    "min-p": dict(temperature=1.0, min_p=0.1),
    # not plain: the general path alone
    "logprobs": dict(temperature=1.0, logprobs=3, seed=7),
    "penalties": dict(temperature=0.0, repetition_penalty=1.3),
    "bias": dict(temperature=0.0, logit_bias={4: 5.0}),
    "min tokens": dict(temperature=1.0, min_tokens=50, stop_token_ids=[1]),
}
PLAIN = ["greedy", "greedy seeded", "seeded", "seeded hot", "unseeded", "top-k top-p", "min-p"]


HAS_LIBRARY = not (build.missing_tools() and build.cached_library() is None)
PATHS = ["kernel", "numpy"] if HAS_LIBRARY else ["numpy"]


@pytest.fixture(autouse=True, scope="module")
def library():
    if HAS_LIBRARY:
        build.load()


@contextmanager
def plain_path(path: str):
    """The plain path as it runs with the C++ library loaded ("kernel") or without it ("numpy")."""
    with pytest.MonkeyPatch.context() as patch:
        if path == "numpy":
            patch.setattr(step_sampling, "greedy_rows", lambda logits: None)
        yield


def requests_of(kinds: list[str]) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100, **KINDS[kind]), eos_token_id=0)
            for i, kind in enumerate(kinds)]


def general(sampler: StepSampler, plan: SchedulerOutput, logits: torch.Tensor) -> SamplerOutput:
    """`StepSampler.sample` as it is without the plain path."""
    entries, logits, non_finite = split_non_finite(plan.scheduled, logits)
    return SamplerOutput(sampler._sample(entries, logits), non_finite)


def plan_of(requests: list[Request]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1) for r in requests if not r.finished])


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 6), plain_only=st.booleans())
def test_plain_steps_match_the_general_path_bitwise(path, seed, size, plain_only):
    with plain_path(path):
        plain_steps_match_the_general_path(seed, size, plain_only)


def plain_steps_match_the_general_path(seed, size, plain_only):
    rng = random.Random(seed)
    kinds = [rng.choice(PLAIN if plain_only else list(KINDS)) for _ in range(size)]
    ours, theirs = requests_of(kinds), requests_of(kinds)
    fast, slow = StepSampler(seed % 1000, EngineMetrics()), StepSampler(seed % 1000, EngineMetrics())
    generator = torch.Generator().manual_seed(seed)
    took_plain = False
    for step in range(6):
        logits = torch.randn(size, VOCAB, generator=generator) * rng.choice([0.5, 3.0])
        if rng.random() < 0.3:  # ties: the first maximum wins on every path
            logits = logits.round()
        if rng.random() < 0.15:
            logits[rng.randrange(size), rng.randrange(VOCAB)] = rng.choice([float("nan"), float("inf"), float("-inf")])
        plan = plan_of(ours)
        took_plain |= plain_requests(plan.scheduled, logits) is not None
        got, want = fast.sample(plan, logits.clone()), general(slow, plan_of(theirs), logits.clone())
        assert got.non_finite == want.non_finite
        assert {k: (v.token_ids, v.logprobs) for k, v in got.tokens.items()} == \
               {k: (v.token_ids, v.logprobs) for k, v in want.tokens.items()}
        for request, twin in zip(ours, theirs):  # as update_from_output would
            sampled = got.tokens.get(request.request_id)
            if sampled is not None:
                request.output_token_ids += sampled.token_ids
                twin.output_token_ids += sampled.token_ids
    assert torch.equal(fast.sampler.generator(torch.device("cpu")).get_state(),
                       slow.sampler.generator(torch.device("cpu")).get_state())
    for request, twin in zip(ours, theirs):
        if request.generator is not None:
            assert torch.equal(request.generator.get_state(), twin.generator.get_state())
    assert took_plain or not plain_only


def test_every_sampled_row_advances_the_engines_stream_by_one_draw_seeded_or_not():
    """A seeded row draws its own number, yet the engine's stream moves on by one
    draw for it as for an unseeded row, so what later unseeded requests sample
    does not depend on whether earlier ones were seeded."""
    later = []
    for first in ("seeded", "unseeded"):
        sampler = StepSampler(0, EngineMetrics())
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
        sampler.sample(plan_of(requests_of([first])), logits)
        unseeded = requests_of(["unseeded"])
        later.append([sampler.sample(plan_of(unseeded), logits * 0.01).tokens["r0"].token_ids[0] for _ in range(8)])
    assert later[0] == later[1]


def test_rows_that_need_processing_are_not_plain():
    logits = torch.zeros(1, VOCAB)
    for kind in ("logprobs", "penalties", "bias", "min tokens"):
        assert plain_requests(plan_of(requests_of([kind])).scheduled, logits) is None, kind
    assert plain_requests(plan_of(requests_of(["seeded"])).scheduled, logits) is not None
    assert plain_requests(plan_of(requests_of(["seeded"])).scheduled, logits.bfloat16()) is None


@pytest.mark.skipif(not HAS_LIBRARY, reason="kvforge's C++ library cannot be built here")
def test_a_plain_cpu_step_takes_one_kernel_call_for_finiteness_and_greedy_tokens(monkeypatch):
    calls = []
    real = step_sampling.greedy_rows

    def counted(logits):
        calls.append(logits.shape)
        return real(logits)

    monkeypatch.setattr(step_sampling, "greedy_rows", counted)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    sampler = StepSampler(0, EngineMetrics())
    out = sampler.sample(plan_of(requests_of(["greedy", "greedy seeded", "greedy"])), logits)
    assert calls == [(3, VOCAB)]
    assert [out.tokens[f"r{i}"].token_ids for i in range(3)] == [[t] for t in logits.argmax(dim=1).tolist()]
    assert real(logits) is not None  # the kernel ran, not the numpy fallback
    logits[1, 5] = float("nan")
    out = sampler.sample(plan_of(requests_of(["greedy", "seeded", "greedy"])), logits)
    assert out.non_finite == ["r1"] and sorted(out.tokens) == ["r0", "r2"]


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 5), greedy_only=st.booleans())
def test_greedy_steps_verifying_drafts_match_the_general_path(path, seed, size, greedy_only):
    """Greedy decodes, some verifying drafts (`plain_greedy_drafts`): the tokens, the
    requests set aside for non-finite logits and the draft counters are those of the
    general path (the rejection sampler), drafts accepted or not."""
    rng = random.Random(seed)
    kinds = [rng.choice(["greedy", "greedy seeded"] if greedy_only else ["greedy", "penalties", "seeded"])
             for _ in range(size)]
    generator = torch.Generator().manual_seed(seed)
    counts = [rng.randint(0, 4) for _ in range(size)]
    logits = torch.randn(sum(counts) + size, VOCAB, generator=generator)
    if rng.random() < 0.3:
        logits = logits.round()  # ties: the first maximum is the target's token
    if rng.random() < 0.2:
        logits[rng.randrange(logits.shape[0]), rng.randrange(VOCAB)] = float("nan")
    target, row, all_drafts = logits.argmax(dim=1).tolist(), 0, []
    for count in counts:  # drafts that match the target for a while, then may not
        all_drafts.append([target[row + j] if rng.random() < 0.7 else rng.randrange(VOCAB) for j in range(count)])
        row += 1 + count

    def plan_with_drafts():  # fresh requests: a seeded one's generator is drawn from
        return SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1 + len(d), d)
                                for r, d in zip(requests_of(kinds), all_drafts)])

    plan = plan_with_drafts()
    assert step_sampling.plain_greedy_drafts(plan.scheduled, logits) == all(k.startswith("greedy") for k in kinds)
    fast, slow = StepSampler(seed % 1000, EngineMetrics()), StepSampler(seed % 1000, EngineMetrics())
    with plain_path(path):
        got = fast.sample(plan, logits.clone())
    want = general(slow, plan_with_drafts(), logits.clone())
    assert got.non_finite == want.non_finite
    assert {k: v.token_ids for k, v in got.tokens.items()} == {k: v.token_ids for k, v in want.tokens.items()}
    counters = ("num_draft_tokens", "num_accepted_tokens", "num_verifications")
    assert [getattr(fast.stats, c) for c in counters] == [getattr(slow.stats, c) for c in counters]
