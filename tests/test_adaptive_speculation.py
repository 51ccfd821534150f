"""Adaptive drafting (`speculative.draft_policy = "adaptive"`): per request, as many
drafts as pay. Speculation that does not pay must stop costing, per request, and
come back when it pays again; greedy output never changes.

The engine measures step costs itself (CPU or wall time); to keep these tests free of
timing, the policy's cost model is replaced by fixed costs where the behaviour
depends on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.core import DraftProposal, SpeculativeProposer, build_registry, hookimpl, load_config
from kvforge.engine.draft_acceptance import AcceptanceTracker
from kvforge.engine.draft_costs import MIN_GAIN, StepCostModel, StepCosts, best_draft_counts, may_pay
from kvforge.engine.draft_policy import PROBE_AFTER, STEADY_FOR

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

MODEL = FakeCausalLM(vocab_size=16, max_model_len=256)
K = 4
COSTS = StepCosts(base=1.0, per_draft=0.2, verify=0.3)  # a verify step with 4 drafts: 2.1x a plain one


class FixedCosts:
    """Stands in for `StepCostModel`: ready, with the same costs whatever the steps took."""

    fits = 0

    def __init__(self, costs: StepCosts = COSTS):
        self._costs = costs

    def ready(self, num_requests: int) -> bool:
        return True

    def costs(self, num_requests: int) -> StepCosts:
        return self._costs

    def observe(self, *args) -> None:
        pass

    def needs_steps_without_drafts(self, num_requests: int) -> bool:
        return False

    def due(self, num_requests: int) -> None:
        return None


class _Planted(SpeculativeProposer):
    """Drafts the model's own greedy continuation ("right") or that plus one at every
    position ("wrong": never accepted), as `right(request_id, output_length)` says."""

    prompt_length = 6

    def right(self, request_id: str, output_length: int) -> bool:
        raise NotImplementedError

    def propose(self, requests, num_tokens):
        proposals = []
        for request in requests:
            tokens = list(request.token_ids)
            truth = reference_greedy(MODEL, tokens, num_tokens)
            if not self.right(request.request_id, len(tokens) - self.prompt_length):
                truth = [(t + 1) % MODEL.vocab_size for t in truth]
            proposals.append(DraftProposal(truth))
        return proposals


class AlwaysWrong(_Planted):
    name = "always-wrong"
    cheap = True

    def right(self, request_id, output_length):
        return False


class AlwaysWrongCostly(AlwaysWrong):
    name = "always-wrong-costly"
    cheap = False


class RightAfter20(_Planted):
    name = "right-after-20"
    cheap = True

    def right(self, request_id, output_length):
        return output_length >= 20


class RightAfter20Costly(RightAfter20):
    name = "right-after-20-costly"
    cheap = False


class RightForGood(_Planted):
    name = "right-for-good"
    cheap = True

    def right(self, request_id, output_length):
        return request_id == "good"


class Plugin:
    @hookimpl
    def kvforge_implementations(self):
        return [AlwaysWrong, AlwaysWrongCostly, RightAfter20, RightAfter20Costly, RightForGood]


def planted_engine(proposer: str, policy: str = "adaptive"):
    registry = build_registry()
    registry.register_plugin(Plugin(), "test-adaptive-proposers")
    engine = fake_engine(MODEL, registry=registry, num_blocks=128, max_num_batched_tokens=64,
                         speculative={"proposer": proposer, "num_tokens": K, "draft_policy": policy})
    if policy == "adaptive":
        engine.drafter.policy.costs = FixedCosts()
    return engine


def run_recording_drafts(engine, prompts: dict[str, list[int]], max_tokens: int):
    """Generate greedily; returns the outputs and, per request, the drafts it verified at
    each decode step (in output-length order: `(output length, drafts)`)."""
    drafts: dict[str, list[tuple[int, int]]] = {request_id: [] for request_id in prompts}
    propose = engine.drafter.propose

    def recording(running):
        chosen = propose(running)
        for request in running:
            if request.request_id in drafts and request.output_token_ids:
                proposal = chosen.get(request.request_id)
                drafts[request.request_id].append(
                    (len(request.output_token_ids), 0 if proposal is None else len(proposal.token_ids)))
        return chosen

    engine.drafter.propose = recording
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return outputs, drafts


PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("proposer", ["always-wrong", "always-wrong-costly"])
def test_a_request_whose_drafts_are_always_rejected_verifies_few_after_warm_up(proposer):
    outputs, drafts = run_recording_drafts(planted_engine(proposer), {"r": PROMPT}, max_tokens=80)
    assert outputs["r"] == reference_greedy(MODEL, PROMPT, 80)
    later = [d for length, d in drafts["r"] if length > 10]
    # without the policy it would verify K drafts on each of these steps
    assert sum(later) <= K * 3, f"verified {sum(later)} drafts over {len(later)} steps after warm-up"
    fixed_outputs, fixed = run_recording_drafts(planted_engine(proposer, "fixed"), {"r": PROMPT}, max_tokens=80)
    assert fixed_outputs["r"] == outputs["r"]
    assert sum(d for length, d in fixed["r"] if length > 10) >= K * (len(later) - K)


@pytest.mark.parametrize("proposer", ["right-after-20", "right-after-20-costly"])
def test_drafting_turns_back_up_when_drafts_start_being_accepted(proposer):
    outputs, drafts = run_recording_drafts(planted_engine(proposer), {"r": PROMPT}, max_tokens=120)
    assert outputs["r"] == reference_greedy(MODEL, PROMPT, 120)
    off = [d for length, d in drafts["r"] if 8 < length < 20]
    assert sum(off) <= K * 2, "while the proposer is wrong, the request should draft (almost) nothing"
    # A costly proposer is probed after PROBE_AFTER, 2 PROBE_AFTER, ... steps; a cheap one's
    # shadow drafts are scored within a few steps.
    settled = [d for length, d in drafts["r"] if length >= 20 + 2 * PROBE_AFTER + 8]
    assert settled and sum(settled) >= 0.75 * K * len(settled), \
        f"drafting did not come back: {settled}"


def test_draft_counts_are_per_request_not_global():
    prompts = {"good": PROMPT, "bad": [7, 8, 9, 10, 11, 12]}
    outputs, drafts = run_recording_drafts(planted_engine("right-for-good"), prompts, max_tokens=60)
    for request_id, prompt in prompts.items():
        assert outputs[request_id] == reference_greedy(MODEL, prompt, 60)
    good = [d for length, d in drafts["good"] if length > 10]
    bad = [d for length, d in drafts["bad"] if length > 10]
    assert sum(good) >= 0.75 * K * len(good)
    assert sum(bad) <= K * 2


def test_requests_that_draft_nothing_ask_a_cheap_proposer_together_on_few_steps():
    engine = planted_engine("always-wrong")
    calls, steps = [], [0]
    propose = engine.drafter.proposer.propose

    def counting(requests, num_tokens):
        calls.append((steps[0], len(requests)))
        return propose(requests, num_tokens)

    engine.drafter.proposer.propose = counting
    step = engine.step

    def counting_step(*args, **kwargs):
        steps[0] = engine.drafter.policy.step + 1  # in decode passes: a burst counts each
        return step(*args, **kwargs)

    engine.step = counting_step
    chosen_at = []
    choose = engine.drafter.policy.choose

    def counting_choose(*args, **kwargs):
        chosen_at.append(steps[0])
        return choose(*args, **kwargs)

    engine.drafter.policy.choose = counting_choose
    prompts = {f"r{i}": [1 + i, 2, 3, 4, 5, 6] for i in range(4)}
    outputs, drafts = run_recording_drafts(engine, prompts, max_tokens=90)
    for request_id, prompt in prompts.items():
        assert outputs[request_id] == reference_greedy(MODEL, prompt, 90)
    late = [(at, asked) for at, asked in calls if at > 30]
    # once their waits reached SHADOW_AFTER_MAX, all four are asked on the same step, one step in 8
    assert late and len(late) <= (steps[0] - 30) // 8 + 1, late
    assert all(asked == len(prompts) for _, asked in late), late
    # and the steps between cost no per-request work: the policy chooses on the step it asks
    # and the one after (the shadow drafts scored), and is skipped on the others
    late_choices = [at for at in chosen_at if at > 30]
    assert len(late_choices) <= 2 * len(late) + 2, (late_choices, late)
    assert sum(d for request_id in prompts for length, d in drafts[request_id] if length > 30) == 0


def test_requests_that_joined_at_different_steps_are_asked_on_the_same_steps():
    from types import SimpleNamespace

    from kvforge.engine.draft_policy import SHADOW_AFTER_MAX, AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=True)
    policy.costs = FixedCosts()
    requests = [SimpleNamespace(request_id=f"r{i}", generator=None, params=SimpleNamespace(greedy=True))
                for i in range(4)]
    for request in requests:
        for _ in range(20):  # every draft it was offered was rejected
            policy.acceptance.of(request.request_id).count(0, 1, policy.acceptance.decay)
    asked_at = {}
    for step in range(120):
        running = requests[: 1 + step // 5]  # one joins every 5 steps
        counts, asks = policy.choose(running, [K] * len(running))
        assert counts == [0] * len(running)
        asked_at[step] = [r.request_id for r, ask in zip(running, asks) if ask]
        policy.observe()
    late = {step: ids for step, ids in asked_at.items() if step >= 60 and ids}
    assert len(late) <= 60 // SHADOW_AFTER_MAX + 1, late
    assert all(len(ids) == len(requests) for ids in late.values()), late


def test_shadow_asks_at_a_large_batch_cost_at_most_the_probe_budget():
    """Asking a cheap proposer for 32 requests' shadow drafts (and scoring them) costs a
    good part of a step; those asks are paid from the allowance, so over many steps
    they cost about PROBE_BUDGET of the time, and every request is still asked."""
    from types import SimpleNamespace

    from kvforge.engine.draft_policy import ALLOWANCE_MAX, PROBE_BUDGET, SHADOW_AFTER_MAX, AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=True)
    policy.costs = FixedCosts()
    policy.propose_seconds = 0.05 * COSTS.base  # one request's ask: 5% of a plain step; all 32: 1.6 steps
    requests = [SimpleNamespace(request_id=f"r{i}", generator=None, params=SimpleNamespace(greedy=True))
                for i in range(32)]
    for request in requests:
        for _ in range(20):  # every draft it was offered was rejected
            policy.acceptance.of(request.request_id).count(0, 1, policy.acceptance.decay)
    steps, asked = 600, {r.request_id: 0 for r in requests}
    for _ in range(steps):
        counts, asks = policy.choose(requests, [K] * len(requests), everyone=True)
        assert counts == [0] * len(requests)
        for request, ask in zip(requests, asks):
            asked[request.request_id] += ask
        policy.observe()
    spent = sum(asked.values()) * 0.05
    assert spent <= PROBE_BUDGET * steps + ALLOWANCE_MAX + 1.6, spent
    assert sum(asked.values()) < len(requests) * steps / SHADOW_AFTER_MAX / 2  # the budget binds: fewer asks
    assert min(asked.values()) >= 3, asked  # yet each request keeps being asked


def test_a_choice_giving_every_request_all_its_drafts_stands_a_few_steps():
    """A batch whose every request drafts all it may reuses that choice for
    STEADY_FOR steps of the same requests, whatever their limits fall to (choosing
    cost a batch-1 step more than it changed), and chooses again once the requests
    change or one ends."""
    from types import SimpleNamespace

    from kvforge.engine.draft_policy import STEADY_FOR, AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=True)
    policy.costs = FixedCosts()
    requests = [SimpleNamespace(request_id=f"r{i}", generator=None, params=SimpleNamespace(greedy=True))
                for i in range(2)]
    for request in requests:
        for _ in range(20):  # every draft accepted
            policy.acceptance.of(request.request_id).count(K, K, policy.acceptance.decay)
    counts, asks = policy.choose(requests, [K, K], everyone=True)
    assert counts == [K, K] and asks == [True, True]
    policy.observe()
    for _ in range(STEADY_FOR - 1):
        assert policy.steady(requests)
        assert not policy.steady(requests[:1]) and not policy.steady(requests[::-1])
        policy.observe()
    assert not policy.steady(requests)  # the window is over: choose again
    policy.choose(requests, [K, K], everyone=True)
    assert policy.steady(requests)
    policy.release("r1")
    assert not policy.steady(requests)


def test_a_steady_batch_times_one_step_in_timed_every():
    """Steps that keep a choice giving every request all its drafts are timed one in
    TIMED_EVERY (with the steps that choose), as a quiet batch's: timing every step
    cost a batch-1 step more than the cost model needed."""
    from kvforge.engine.drafting import TIMED_EVERY

    engine = planted_engine("right-for-good")
    timed = []
    engine.drafter.policy.timed = lambda *args: timed.append(args)
    _, drafts = run_recording_drafts(engine, {"good": PROMPT}, max_tokens=120)
    verifying = sum(1 for _, d in drafts["good"] if d == K)
    assert verifying >= 20  # every draft is right: it drafts all it may
    full = sum(1 for _, num_drafts, _ in timed if num_drafts == K)  # steps verifying all K
    assert 0 < full <= verifying / TIMED_EVERY + verifying / STEADY_FOR + 1, (full, verifying, timed)


def test_warm_up_shows_the_cost_model_plain_full_and_half_drafts():
    engine = planted_engine("always-wrong")
    engine.drafter.policy.costs = StepCostModel()  # the real one, not yet ready
    _, drafts = run_recording_drafts(engine, {"r": PROMPT}, max_tokens=12)
    seen = {d for _, d in drafts["r"][:8]}
    assert {0, K, K // 2} <= seen, drafts["r"]


def test_fixed_policy_verifies_num_tokens_drafts_on_every_decode_step():
    outputs, drafts = run_recording_drafts(planted_engine("always-wrong", "fixed"), {"r": PROMPT}, max_tokens=30)
    assert outputs["r"] == reference_greedy(MODEL, PROMPT, 30)
    assert all(d == min(K, 30 - length - 1) for length, d in drafts["r"]), drafts["r"]
    assert planted_engine("always-wrong", "fixed").drafter.policy is None


def test_draft_policy_is_checked():
    with pytest.raises(Exception, match="draft_policy"):
        load_config(speculative={"proposer": "ngram", "draft_policy": "sometimes"})


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_adaptive_greedy_output_is_identical_to_no_speculation(proposer):
    prompts = ["def area(w, h):\n    return w * h\n\ndef area(", "Once upon a time, there was a "]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)

    def generate(speculative):
        config = load_config(model="kvforge-tiny", device="cpu", dtype="float32", warmup=False,
                             cache={"memory_budget": 2**26}, speculative=speculative).config
        engine = LLMEngine(config)
        token_ids = [list(engine.tokenizer.encode(p)) for p in prompts]
        outputs = LLM.from_engine(engine).generate(prompt_token_ids=token_ids, sampling_params=params)
        return [list(o.outputs[0].token_ids) for o in outputs], engine

    plain, _ = generate({})
    adaptive, engine = generate({"proposer": proposer, "num_tokens": K})
    assert engine.drafter.policy is not None
    assert adaptive == plain
    assert engine.metrics()["spec_draft_tokens"] > 0  # it did speculate: the comparison means something


# The choice, on synthetic numbers

def geometric_gains(alpha: float, k: int = K) -> list[float]:
    return [alpha ** (j + 1) for j in range(k)]


def test_no_drafts_when_verification_costs_more_than_it_yields():
    # A step with d drafts costs 1 + 0.3 + 0.2 d; it yields 1 + alpha + ... + alpha^d tokens.
    assert best_draft_counts([geometric_gains(0.1)], COSTS) == [0]
    assert best_draft_counts([geometric_gains(0.3)], COSTS) == [0]
    assert best_draft_counts([geometric_gains(0.9)], COSTS) == [K]
    assert best_draft_counts([geometric_gains(0.9)], StepCosts(1.0, 0.2, 5.0)) == [0]  # verifying alone costs 5x
    free = StepCosts(1.0, 0.0, 0.0)
    assert best_draft_counts([geometric_gains(0.05)], free) == [K]  # drafts that cost nothing always pay


def test_the_choice_maximises_expected_tokens_per_second():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        gains = [geometric_gains(rng.random(), rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]
        costs = StepCosts(rng.uniform(0.5, 2), rng.uniform(0, 1), rng.uniform(0, 2))

        def rate(counts):
            return (len(gains) + sum(sum(row[:c]) for row, c in zip(gains, counts))) / costs.seconds(sum(counts))

        best = max(rate(c) for c in itertools.product(*[range(len(row) + 1) for row in gains]))
        plain = rate([0] * len(gains))
        want = best if best > plain * (1 + MIN_GAIN) else plain  # drafts must pay MIN_GAIN to be taken
        assert rate(best_draft_counts(gains, costs)) == pytest.approx(want, rel=1e-9)


def test_per_request_choice_in_one_batch():
    assert best_draft_counts([geometric_gains(0.95), geometric_gains(0.05)], COSTS) == [K, 0]


def _measured_steps(model: StepCostModel, num_requests: int, costs: StepCosts, steps: int, *,
                    load=lambda step: 1.0, drafts=(0, 4, 8, 16, 0, 12)) -> None:
    """Feed `model` steps at `num_requests` that cost `costs` times `load(step)`, with a
    stall (20x) now and then."""
    for step in range(steps):
        num_drafts = drafts[step % len(drafts)]
        seconds = costs.seconds(num_drafts) * load(step) * (20 if step % 17 == 5 else 1)
        model.observe(num_requests, num_drafts, seconds)


def test_step_cost_model_recovers_costs_and_shrugs_off_stalls():
    model = StepCostModel()
    assert not model.ready(2)
    truth = StepCosts(base=1.4e-3, per_draft=0.15e-3, verify=0.4e-3)
    _measured_steps(model, 2, truth, 120)
    assert model.ready(2) and model.ready(3)  # one bucket: 2-3
    costs = model.costs(2)
    assert costs.base == pytest.approx(truth.base, rel=0.02)
    assert costs.per_draft == pytest.approx(truth.per_draft, rel=0.05)
    assert costs.verify == pytest.approx(truth.verify, rel=0.05)


def test_step_cost_model_follows_a_load_that_scales_every_step():
    # Other work on the host slows every step 2x from step 60 on: drafts cost the same
    # relative to a plain step, and the estimate follows the new base.
    model = StepCostModel()
    truth = StepCosts(base=1e-3, per_draft=0.2e-3, verify=0.5e-3)
    _measured_steps(model, 1, truth, 200, load=lambda step: 2.0 if step >= 60 else 1.0)
    costs = model.costs(1)
    assert costs.base == pytest.approx(2 * truth.base, rel=0.02)
    assert costs.per_draft / costs.base == pytest.approx(truth.per_draft / truth.base, rel=0.05)
    assert costs.verify / costs.base == pytest.approx(truth.verify / truth.base, rel=0.05)


def test_step_cost_model_charges_a_single_draft_count_to_verify():
    # Every step verified the same 8 drafts: the slope is unknown, and the extra is charged
    # once per step, so fewer drafts are never estimated cheaper than they might be.
    model = StepCostModel()
    truth = StepCosts(base=1e-3, per_draft=0.1e-3, verify=0.2e-3)
    _measured_steps(model, 1, truth, 40, drafts=(0, 8))
    costs = model.costs(1)
    assert costs.per_draft == 0.0
    assert costs.seconds(1) >= truth.seconds(1) and costs.seconds(8) == pytest.approx(truth.seconds(8), rel=0.01)


AT_1 = StepCosts(base=1e-3, per_draft=0.15e-3, verify=0.3e-3)  # 4 drafts: 1.9x a plain step
AT_32 = StepCosts(base=2.7e-3, per_draft=0.05e-3, verify=0.5e-3)  # 128 drafts: 3.5x a plain step


def _steps_at_batch_1_and_32(model: StepCostModel) -> None:
    """Steps of batch 1 and of batch 32 in turn (requests arrive and finish): a draft
    costs 0.15 of a plain step at batch 1, where a verify step reads the weights once for
    several tokens, and 0.02 of one at batch 32, where each draft is another row of a
    compute-bound step (yet there a plain step yields 32 tokens, not 1)."""
    for _ in range(10):
        _measured_steps(model, 1, AT_1, 12, drafts=(0, 4, 2, 4, 0, 3))
        _measured_steps(model, 32, AT_32, 12, drafts=(0, 32, 64, 128, 0, 96))


def test_step_cost_model_keeps_batch_sizes_apart():
    model = StepCostModel()
    _measured_steps(model, 1, AT_1, 60)
    assert not model.ready(32)  # nothing measured at 32 yet: it warms up there rather than guess
    _steps_at_batch_1_and_32(model)
    for num_requests, truth in ((1, AT_1), (32, AT_32)):
        costs = model.costs(num_requests)
        assert costs.base == pytest.approx(truth.base, rel=0.02)
        assert costs.per_draft == pytest.approx(truth.per_draft, rel=0.05)
        assert costs.verify == pytest.approx(truth.verify, rel=0.05)


def test_batch_32_verifies_only_drafts_accepted_far_more_often_than_batch_1_needs():
    model = StepCostModel()
    _steps_at_batch_1_and_32(model)
    half, most = geometric_gains(0.5), geometric_gains(0.9)
    assert best_draft_counts([half], model.costs(1)) == [2]  # 1.75 tokens for 1.6x the step
    assert best_draft_counts([half] * 32, model.costs(32)) == [0] * 32  # 48 tokens for 1.8x at best
    assert best_draft_counts([most] * 32, model.costs(32)) == [3] * 32  # 110 tokens for 3x (a 4th adds 0.66)


def test_may_pay_is_false_only_where_no_drafts_pay():
    import random

    rng = random.Random(1)
    for _ in range(500):
        gains = [geometric_gains(rng.random() ** 3, rng.randint(1, 4)) for _ in range(rng.randint(1, 6))]
        costs = StepCosts(rng.uniform(0.5, 2), rng.uniform(0, 0.3), rng.uniform(0, 1))
        bound = may_pay(max(row[0] for row in gains), sum(map(len, gains)), len(gains), costs)
        if not bound:
            assert best_draft_counts(gains, costs) == [0] * len(gains)


def test_shadow_scoring_counts_leading_matches_against_the_tokens_that_follow():
    class Request:
        def __init__(self, prompt, output):
            self.request_id, self.prompt_token_ids, self.output_token_ids = "r", prompt, output

        @property
        def num_tokens(self):
            return len(self.prompt_token_ids) + len(self.output_token_ids)

    request = Request([1, 2, 3], [])
    tracker = AcceptanceTracker(decay=1.0)
    tracker.propose(request, [4, 5, 9, 7])
    request.output_token_ids += [4, 5]
    tracker.score(request)
    assert tracker.of("r").scored == []  # two matched so far: not decided yet
    request.output_token_ids += [6]
    tracker.score(request)
    state = tracker.of("r")
    assert state.scored == [1, 1, 1] and state.accepted == [1, 1, 0] and not state.pending
    tracker.propose(request, [8], fresh=True)
    request.output_token_ids += [8]
    tracker.score(request)
    assert state.scored == [1] and state.accepted == [1]  # a probe's outcome replaces what came before


def test_decayed_counts_follow_the_recurrence_across_rescaling(monkeypatch):
    """Counts held with one shared scale equal `x <- x * decay + outcome` per position,
    also after the scale is folded back into them."""
    import random

    from kvforge.engine import draft_acceptance

    monkeypatch.setattr(draft_acceptance, "RESCALE_ABOVE", 50.0)  # fold every few counts
    rng = random.Random(7)
    state, decay = draft_acceptance.RequestAcceptance(), 0.8
    scored, accepted = [0.0] * K, [0.0] * K
    for _ in range(200):
        num_scored = rng.randint(1, K)
        num_accepted = rng.choice([num_scored - 1, num_scored]) if num_scored < K else rng.randint(K - 1, K)
        state.count(num_accepted, num_scored, decay)
        for j in range(K):
            scored[j] = scored[j] * decay + (j < num_scored)
            accepted[j] = accepted[j] * decay + (j < num_accepted)
        prior = [0.5] * K
        want = [(a + 0.5 * draft_acceptance.PRIOR_WEIGHT) / (n + draft_acceptance.PRIOR_WEIGHT)
                for a, n in zip(accepted, scored)]
        assert state.rates(K, prior) == pytest.approx(want, rel=1e-9)
    assert state.scale <= 50.0


def test_counting_outcomes_together_equals_counting_them_one_by_one(monkeypatch):
    """`verified_all` over interleaved requests' outcomes leaves every request's counts,
    the engine's and the prior's refresh as counting each outcome in turn does, also
    across rescaling."""
    import random

    from kvforge.engine import draft_acceptance

    monkeypatch.setattr(draft_acceptance, "RESCALE_ABOVE", 50.0)
    rng = random.Random(11)
    one, together = AcceptanceTracker(), AcceptanceTracker()
    for _ in range(40):
        chunk = []
        for _ in range(rng.randint(1, 9)):
            num_scored = rng.randint(1, K)
            chunk.append((f"r{rng.randrange(3)}", rng.choice([num_scored - 1, num_scored]), num_scored))
        for request_id, num_accepted, num_scored in chunk:
            one.verified(request_id, num_accepted, num_scored)
        states = together.verified_all(chunk)
        assert sorted(request_id for _, request_id in states) == sorted({request_id for request_id, *_ in chunk})
        for tracker_state, other in [(together.engine, one.engine)] + [
                (together.of(r), one.of(r)) for r in ("r0", "r1", "r2")]:
            assert [x / tracker_state.scale for x in tracker_state.scored] == pytest.approx(
                [x / other.scale for x in other.scored], rel=1e-12)
            assert [x / tracker_state.scale for x in tracker_state.accepted] == pytest.approx(
                [x / other.scale for x in other.accepted], rel=1e-12)
            assert (tracker_state.hits, tracker_state.counted) == (other.hits, other.counted)
        assert (together.changes, together._prior is None) == (one.changes, one._prior is None)
        for request_id in ("r0", "r1", "r2"):
            assert together.gains(request_id, K) == pytest.approx(one.gains(request_id, K), rel=1e-12)


def test_a_steady_window_counts_every_steps_outcome_when_it_ends():
    """Steps that keep a choice giving every request all its drafts are not shown to the
    policy's proposal bookkeeping: their outcomes, read off the step, are held, and the
    next choice counts them in the order they came, as counting each on its step would
    (a request's estimate, the engine's, and its hits)."""
    import random

    from kvforge.engine.draft_policy import AdaptiveDraftPolicy

    rng = random.Random(5)
    policy, reference = AdaptiveDraftPolicy(cheap_proposer=True), AcceptanceTracker()
    policy.costs = FixedCosts(StepCosts(base=1.0, per_draft=0.01, verify=0.1))  # drafts cheap: all pay
    requests = [_Tokens(f"r{i}") for i in range(2)]
    for request in requests:
        request.finished = False
        for _ in range(20):  # every draft accepted
            policy.acceptance.verified(request.request_id, K, K)
            reference.verified(request.request_id, K, K)
    for window in range(3):
        counts, _ = policy.choose(requests, [K, K], everyone=True)
        assert counts == [K, K]
        held_gains = [policy.acceptance.gains(r.request_id, K) for r in requests]
        for request, held in zip(requests, held_gains):  # (reading the prior when the policy does)
            assert held == pytest.approx(reference.gains(request.request_id, K), rel=1e-12)
        for step in range(STEADY_FOR):
            assert policy.steady(requests) or not step  # the choice's own step, then the window
            entries = []
            for request in requests:
                if not step:
                    policy.proposed(request, [7] * K, num_verified=K)
                entries.append(_Step(request, [7] * K))
                accepted = rng.choice([1, K - 1, K]) if window < 2 else 0  # the last window accepts nothing
                request.output_token_ids += [7] * accepted + [1]
                reference.verified(request.request_id, accepted, min(accepted + 1, K))
            policy.observe(entries)
            assert [policy.acceptance.gains(r.request_id, K) for r in requests] == held_gains  # held
        assert not policy.steady(requests)
    policy.choose(requests, [K, K], everyone=True)
    for request, held in zip(requests, held_gains):
        gains = policy.acceptance.gains(request.request_id, K)
        assert gains == pytest.approx(reference.gains(request.request_id, K), rel=1e-12)
        assert policy.acceptance.of(request.request_id).hits == reference.of(request.request_id).hits
        assert gains[0] < 0.6 * held[0]  # the window that accepted nothing counted at its end


class _Step:
    """A request a step verified drafts of, as `ScheduledRequest` names it."""

    def __init__(self, request, drafts):
        self.request, self.start, self.draft_token_ids = request, request.num_tokens - 1, drafts


def test_a_proposal_verified_whole_counts_as_scoring_it_would():
    """Counting a verified proposal from the tokens the step emitted gives the same
    estimates as keeping it and scoring it against those tokens; where the scheduler
    verified fewer drafts than proposed and all were accepted, only those count."""
    import random

    from kvforge.engine.draft_policy import AdaptiveDraftPolicy

    rng = random.Random(3)
    counting, scoring = AdaptiveDraftPolicy(cheap_proposer=True), AdaptiveDraftPolicy(cheap_proposer=True)
    ids = {policy: _Tokens("r") for policy in (counting, scoring)}
    for request in ids.values():
        request.finished = False
    for _ in range(100):
        drafts = [rng.randrange(4) for _ in range(K)]
        follow = [rng.randrange(4) for _ in range(K + 1)]  # the target's tokens at those positions
        accepted = next((j for j in range(K) if drafts[j] != follow[j]), K)
        emitted = drafts[:accepted] + [follow[accepted]]
        counting.proposed(ids[counting], drafts, num_verified=K)
        step = _Step(ids[counting], drafts)
        ids[counting].output_token_ids += emitted
        counting.observe([step])
        scoring.proposed(ids[scoring], drafts)
        ids[scoring].output_token_ids += emitted
        scoring.observe()
        assert counting.acceptance.gains("r", K) == pytest.approx(scoring.acceptance.gains("r", K))
        assert counting.acceptance.of("r").hits == scoring.acceptance.of("r").hits
    cut = AdaptiveDraftPolicy(cheap_proposer=True)
    request = _Tokens("r")
    request.finished = False
    cut.proposed(request, [5, 5, 5, 5], num_verified=K)
    step = _Step(request, [5, 5])  # the scheduler made room for two
    request.output_token_ids += [5, 5, 6]
    cut.observe([step])
    state = cut.acceptance.of("r")
    assert [x / state.scale for x in state.scored] == [1, 1] and state.accepted == state.scored


# What probing may cost: probes that verify drafts spend an allowance

class _Tokens:
    """A request as the policy and the acceptance tracker read it."""

    def __init__(self, request_id: str):
        self.request_id, self.generator = request_id, None
        self.params = type("Params", (), {"greedy": True})()
        self.prompt_token_ids, self.output_token_ids = [1, 2, 3], []

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _drive(policy, requests, steps: int, emit, idle: list[int] | None = None) -> list[tuple[int, int, int]]:
    """`steps` steps of `requests` (all decoding, limit K); each asked request is proposed
    [7] * K and then emits `emit(step, request_index, drafts_verified)` tokens. Returns
    (step, request index, drafts verified) of every request that verified drafts. As the
    engine does, a step the policy calls `quiet` asks nobody and is not chosen; `idle`
    collects the steps chosen on which nobody was asked."""
    verified = []
    for step in range(steps):
        if policy.quiet(len(requests)):
            counts, asks = [0] * len(requests), [False] * len(requests)
        else:
            counts, asks = policy.choose(requests, [K] * len(requests), everyone=True)
            if idle is not None and not any(asks):
                idle.append(step)
        for i, (request, count, ask) in enumerate(zip(requests, counts, asks)):
            if ask:
                policy.proposed(request, [7] * K)
            if count:
                verified.append((step, i, count))
            request.output_token_ids += emit(step, i, count)
        policy.observe()
    return verified


def test_probes_under_a_costly_proposer_cost_at_most_the_probe_budget():
    from kvforge.engine.draft_policy import ALLOWANCE_MAX, PROBE_BUDGET, AdaptiveDraftPolicy

    costs = StepCosts(base=1.0, per_draft=0.3, verify=0.5)  # 32 requests' probes: 38.9 plain steps
    policy = AdaptiveDraftPolicy(cheap_proposer=False)
    policy.costs = FixedCosts(costs)
    requests = [_Tokens(f"r{i}") for i in range(32)]
    for request in requests:  # the engine has seen drafts rejected: nobody drafts but to probe
        policy.acceptance.of(request.request_id).count(0, 1, policy.acceptance.decay)
    steps = 600
    verified = _drive(policy, requests, steps, lambda step, i, count: [8])  # every draft rejected
    assert verified, "a costly proposer is still probed"
    by_step: dict[int, int] = {}
    for step, _, count in verified:
        by_step[step] = by_step.get(step, 0) + count
    spent = sum(costs.seconds(drafts) / costs.base - 1 for drafts in by_step.values())
    # what probes cost, in plain steps: at most the budget's share plus what the allowance
    # holds at the start and one probe it lets go into debt
    assert spent <= PROBE_BUDGET * steps + ALLOWANCE_MAX + costs.seconds(K * 32) / costs.base, (spent, by_step)


def test_a_costly_probe_that_hits_does_not_bring_the_next_probe_sooner():
    # Drafts that never pay (a draft costs more than the most it can add): a probe whose
    # first draft is accepted changes the estimate, which decides; the wait still doubles.
    from kvforge.engine.draft_policy import PROBE_AFTER_MAX, AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=False)
    policy.costs = FixedCosts(StepCosts(base=1.0, per_draft=1.5, verify=0.5))
    request = _Tokens("r")
    steps = 400

    def emit(step, i, count):
        policy.allowance = 1e9  # the allowance out of the picture: only the waits decide
        return [7, 8] if count else [8]  # a verified probe's first draft is accepted

    verified = _drive(policy, [request], steps, emit)
    probes = [step for step, _, _ in verified]
    # waits of 16, 32, 64, then PROBE_AFTER_MAX: a hit halving them would probe every 16 steps
    assert probes and len(probes) <= 4 + (steps - 112) // PROBE_AFTER_MAX, probes


def test_a_new_batch_size_warms_up_within_the_allowance_once_another_is_measured():
    from kvforge.engine.draft_policy import ALLOWANCE_MAX, PROBE_BUDGET, AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=True)
    _measured_steps(policy.costs, 32, AT_32, 60, drafts=(0, 32, 64, 128, 0, 96))
    assert policy.costs.ready(32) and not policy.costs.ready(20)
    stand_in = policy.costs.stand_in(20)
    assert stand_in == policy.costs.costs(32)
    requests = [_Tokens(f"r{i}") for i in range(20)]
    steps = 200
    verified = _drive(policy, requests, steps, lambda step, i, count: [8])
    by_step: dict[int, int] = {}
    for step, _, count in verified:
        by_step[step] = by_step.get(step, 0) + count
    spent = sum(stand_in.seconds(drafts) / stand_in.base - 1 for drafts in by_step.values())
    assert by_step, "it still warms up"
    assert spent <= PROBE_BUDGET * steps + ALLOWANCE_MAX + stand_in.seconds(K * 20) / stand_in.base, by_step
    # a fresh engine (no batch size measured) warms up at once: every warm-up step but the plain ones drafts
    fresh = AdaptiveDraftPolicy(cheap_proposer=True)
    warm = _drive(fresh, [_Tokens(f"f{i}") for i in range(20)], 12, lambda step, i, count: [8])
    assert len({step for step, _, _ in warm}) >= 6


def test_a_shadow_hit_that_cannot_make_drafting_pay_leaves_the_batch_quiet():
    # Drafts never pay at these costs; one request's shadow drafts hit now and then. Its
    # wait shortens, but the steps until someone is due stay quiet: no per-request work.
    from kvforge.engine.draft_policy import AdaptiveDraftPolicy

    policy = AdaptiveDraftPolicy(cheap_proposer=True)
    policy.costs = FixedCosts(StepCosts(base=1.0, per_draft=1.5, verify=0.5))
    requests = [_Tokens(f"r{i}") for i in range(8)]
    idle: list[int] = []

    def emit(step, i, count):
        return [7] if i == 0 and step % 24 == 0 else [8]  # r0's draft is right on steps 0, 24, ...

    _drive(policy, requests, 240, emit, idle)
    assert any(pause.hits for pause in policy.pauses.values()), "the planted hits were scored"
    assert idle == [], idle


def test_a_quiet_batch_bursts_up_to_its_next_ask_and_counts_every_pass():
    # Drafts that never pay: the batch goes quiet, and its steps run as multi-step bursts,
    # none past the step on which the request is due to be asked again; the policy counts
    # every pass as a step, so its waits stay waits in tokens.
    engine = planted_engine("always-wrong")
    policy, drafter = engine.drafter.policy, engine.drafter
    engine.add_request("r", prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=120,
                                                                           ignore_eos=True))
    propose, chosen = drafter.propose, {}

    def noting(running):  # the state the step's choice left
        drafts = propose(running)
        chosen.update(quiet=policy.quiet(len(running)), next_ask=policy._next_ask, drafts=drafts)
        return drafts

    drafter.propose = noting
    tokens, bursts = 0, 0
    while engine.has_unfinished_requests():
        before = policy.step
        [output] = engine.step()
        grown, tokens = len(output.outputs[0].token_ids) - tokens, len(output.outputs[0].token_ids)
        if grown > 1:
            bursts += 1
            assert chosen["quiet"] and not chosen["drafts"]
            assert policy.step - before == grown and policy.step <= chosen["next_ask"]
    assert output.outputs[0].token_ids == reference_greedy(MODEL, PROMPT, 120)
    assert bursts > 3 and engine.stats.num_steps < 120 / 2


def test_fixed_drafting_schedules_every_step():
    outputs, drafts = run_recording_drafts(planted_engine("always-wrong", "fixed"), {"r": PROMPT}, max_tokens=40)
    assert outputs["r"] == reference_greedy(MODEL, PROMPT, 40)
    assert all(d == K or length + d >= 39 for length, d in drafts["r"])  # drafts every step, none burst


def test_a_batch_above_disable_above_batch_size_bursts_as_without_speculation():
    prompts = {f"r{i}": [i + 1, 2, 3, 4] for i in range(3)}
    engine = fake_engine(MODEL, num_blocks=128, max_num_batched_tokens=64,
                         speculative={"proposer": "ngram", "num_tokens": K, "disable_above_batch_size": 2})
    outputs, drafts = run_recording_drafts(engine, prompts, max_tokens=40)
    assert all(outputs[r] == reference_greedy(MODEL, p, 40) for r, p in prompts.items())
    assert engine.stats.num_steps < 40 / 2


def test_a_burst_is_timed_per_pass():
    # A burst of plain passes tells the cost model what one pass costs, so drafts are
    # weighed against a pass as cheap as bursts make it, not against a whole burst.
    from kvforge.engine.request import Request
    from kvforge.engine.scheduler_output import ScheduledRequest

    drafter = planted_engine("always-wrong").drafter
    timed, now = [], [0.0]
    drafter.policy.timed = lambda requests, drafts, seconds: timed.append((requests, drafts, seconds))
    drafter.clock = lambda: now[0]
    request = Request("r", PROMPT, SamplingParams(temperature=0, max_tokens=50))
    request.output_token_ids.append(3)
    for passes, seconds in ((4, 2.0), (1, 0.75)):
        drafter.propose([])  # the step starts (nobody decodes yet: nothing asked)
        now[0] += seconds
        drafter.observe([ScheduledRequest(request, request.num_tokens - 1, 1)], passes)
    drafter.propose([])
    assert timed == [(1, 0, 0.5), (1, 0, 0.75)]


def test_a_seeded_sampled_request_keeps_every_step_scheduled_beside_speculation():
    # Where a burst ends depends on time; a seeded sample's draws depend on which of its
    # tokens were verified drafts, so with one running no step bursts, and its output
    # repeats run to run. Greedy requests alone burst (above disable_above_batch_size).
    def run_pair(seeded: bool):
        engine = fake_engine(MODEL, num_blocks=128, max_num_batched_tokens=64,
                             speculative={"proposer": "ngram", "num_tokens": K, "disable_above_batch_size": 1})
        sampled = (SamplingParams(temperature=0.9, seed=5, max_tokens=30, ignore_eos=True) if seeded
                   else SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.add_request("a", prompt_token_ids=PROMPT, params=sampled)
        engine.add_request("b", prompt_token_ids=PROMPT[::-1],
                           params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] = output.outputs[0].token_ids
        return engine.stats.num_steps, tokens

    steps, _ = run_pair(seeded=False)
    assert steps < 30 / 2
    steps, first = run_pair(seeded=True)
    assert steps >= 30 and run_pair(seeded=True)[1] == first
