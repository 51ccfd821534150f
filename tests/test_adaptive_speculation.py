"""Adaptive drafting (`speculative.draft_policy = "adaptive"`): per request, as many
drafts as pay. Speculation that does not pay must stop costing, per request, and
come back when it pays again; greedy output never changes.

The engine measures step costs itself (wall time); to keep these tests free of
timing, the policy's cost model is replaced by fixed costs where the behaviour
depends on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.core import DraftProposal, SpeculativeProposer, build_registry, hookimpl, load_config
from kvforge.engine.draft_acceptance import AcceptanceTracker
from kvforge.engine.draft_costs import StepCostModel, StepCosts, best_draft_counts
from kvforge.engine.draft_policy import PROBE_AFTER

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

MODEL = FakeCausalLM(vocab_size=16, max_model_len=256)
K = 4
COSTS = StepCosts(base=1.0, per_draft=0.2, verify=0.3)  # a verify step with 4 drafts: 2.1x a plain one


class FixedCosts:
    """Stands in for `StepCostModel`: ready, with the same costs whatever the steps took."""

    ready = True
    fits = 0

    def __init__(self, costs: StepCosts = COSTS):
        self._costs = costs

    def costs(self, num_requests: int) -> StepCosts:
        return self._costs

    def observe(self, *args) -> None:
        pass

    def needs_steps_without_drafts(self) -> bool:
        return False


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
        assert rate(best_draft_counts(gains, costs)) == pytest.approx(best, rel=1e-9)


def test_per_request_choice_in_one_batch():
    assert best_draft_counts([geometric_gains(0.95), geometric_gains(0.05)], COSTS) == [K, 0]


def test_step_cost_model_recovers_costs_and_shrugs_off_stalls():
    model = StepCostModel()
    assert not model.ready
    truth = StepCosts(base=0.0, per_draft=0.15e-3, verify=0.4e-3)
    for step in range(300):
        requests, drafts = 1 + step % 3, (0, 1, 2, 4, 0, 3)[step % 6]
        seconds = 1e-3 + 0.2e-3 * requests + (truth.verify + truth.per_draft * drafts if drafts else 0)
        model.observe(requests, drafts, seconds * (20 if step % 17 == 5 else 1))  # now and then a stall
    assert model.ready
    costs = model.costs(2)
    assert costs.base == pytest.approx(1.4e-3, rel=0.05)
    assert costs.per_draft == pytest.approx(truth.per_draft, rel=0.1)
    assert costs.verify == pytest.approx(truth.verify, rel=0.3)  # each stall still counts 1.5x


def test_shadow_scoring_counts_leading_matches_against_the_tokens_that_follow():
    class Request:
        def __init__(self, prompt, output):
            self.request_id, self.prompt_token_ids, self.output_token_ids = "r", prompt, output

        @property
        def num_tokens(self):
            return len(self.prompt_token_ids) + len(self.output_token_ids)

    request = Request([1, 2, 3], [])
    tracker = AcceptanceTracker(decay=1.0)
    tracker.propose("r", request.num_tokens, [4, 5, 9, 7])
    request.output_token_ids += [4, 5]
    tracker.score(request)
    assert tracker.of("r").scored == []  # two matched so far: not decided yet
    request.output_token_ids += [6]
    tracker.score(request)
    state = tracker.of("r")
    assert state.scored == [1, 1, 1] and state.accepted == [1, 1, 0] and not state.pending
    tracker.propose("r", request.num_tokens, [8], fresh=True)
    request.output_token_ids += [8]
    tracker.score(request)
    assert state.scored == [1] and state.accepted == [1]  # a probe's outcome replaces what came before
