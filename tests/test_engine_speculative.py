"""Speculative decoding through the engine over the fake model: greedy output is
token-for-token the output without speculation in every scheduling situation,
rejected drafts give their blocks back, only accepted tokens reach the prefix
cache, limits and stops hold inside an accepted run, and a proposer that breaks
its contract is refused by name without corrupting any request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvforge import SamplingParams
from kvforge.core import DraftProposal, SpeculativeProposer, build_registry, hookimpl
from kvforge.engine.drafting import ProposerError

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

MODEL = FakeCausalLM(vocab_size=12)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5], [3, 3, 3, 3], [9, 8, 1, 2, 3, 9, 8]]
NGRAM = {"proposer": "ngram", "num_tokens": 4, "options": {"min_n": 1}}


class Plugin:
    """An in-process plugin holding test proposers."""

    def __init__(self, *classes):
        self.classes = classes

    @hookimpl
    def kvforge_implementations(self):
        return list(self.classes)


class OracleProposer(SpeculativeProposer):
    """Proposes the fake model's own greedy continuation, wrong at every third
    draft, so every step both accepts and rejects."""

    name = "oracle"
    wrong_every = 3
    model = MODEL

    def propose(self, requests, num_tokens):
        out = []
        for r in requests:
            guess = reference_greedy(self.model, list(r.token_ids), num_tokens)
            out.append(DraftProposal([(t + 1) % 12 if i % self.wrong_every == self.wrong_every - 1 else t
                                      for i, t in enumerate(guess)]))
        return out


class PerfectProposer(OracleProposer):
    """Always right: every draft is accepted, so stops land inside accepted runs."""

    name = "perfect"
    wrong_every = 10**9


PERFECT = {"proposer": "perfect", "num_tokens": 8}
DIVERSE = [5, 6, 7, 5, 6, 7, 5]  # greedy output 4, 10, 10, 10, 2, ...: token 2 first appears fifth


def registry_with(*classes):
    registry = build_registry()
    registry.register_plugin(Plugin(*classes), "test-proposers")
    return registry


def run(speculative=None, prompts=PROMPTS, params=None, registry=None, **kwargs):
    engine = fake_engine(MODEL, speculative=speculative, registry=registry, **kwargs)
    params = params or SamplingParams(temperature=0, max_tokens=24)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert engine.kv.usage().in_use == 0 and engine.kv.requests == {}
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("speculative", [NGRAM, {"proposer": "oracle", "num_tokens": 3}], ids=["ngram", "oracle"])
@pytest.mark.parametrize("setting", [
    {},
    {"max_num_batched_tokens": 5},  # chunked prefill, and drafts cut by the budget
    {"num_blocks": 12, "block_size": 4},  # preemption and recomputation
    {"prefix_caching": False},
])
def test_greedy_output_is_identical_with_speculation(speculative, setting):
    registry = registry_with(OracleProposer)
    plain, _ = run(registry=registry, **setting)
    spec, engine = run(speculative, registry=registry, **setting)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.token_ids for o in plain] == [reference_greedy(MODEL, p, 24) for p in PROMPTS]
    figures = engine.metrics()
    assert figures["spec_draft_tokens"] > figures["spec_accepted_tokens"] > 0
    if "num_blocks" in setting:
        assert figures["preemptions"] > 0


def test_oracle_acceptance_figures_add_up():
    _, engine = run({"proposer": "oracle", "num_tokens": 3}, registry=registry_with(OracleProposer))
    figures = engine.metrics()
    assert figures["spec_acceptance_rate"] == pytest.approx(figures["spec_accepted_tokens"] / figures["spec_draft_tokens"])
    # Drafts are wrong at every third place: at most two of three are ever accepted.
    assert 1 <= figures["spec_mean_accepted_tokens"] <= 2
    assert figures["steps"] < run(num_scheduler_steps=1)[1].metrics()["steps"]  # fewer than one token a step


def test_n_samples_fork_and_speculate_like_without():
    params = SamplingParams(temperature=0, max_tokens=16, n=3)
    plain, _ = run(params=params)
    spec, _ = run(NGRAM, params=params)
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]


def test_logprobs_cover_every_emitted_token():
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    plain, _ = run(params=params)
    spec, engine = run(NGRAM, params=params)
    assert engine.metrics()["spec_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert len(b.logprobs) == len(b.token_ids) == len(a.logprobs)
        for token, x, y in zip(b.token_ids, a.logprobs, b.logprobs):
            assert token in y and set(x) == set(y)
            assert all(x[t] == pytest.approx(y[t], abs=1e-4) for t in x)
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("speculative", [NGRAM, PERFECT], ids=["ngram", "perfect"])
def test_max_tokens_is_never_passed_inside_an_accepted_run(max_tokens, speculative):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    spec, _ = run(speculative, params=params, registry=registry_with(PerfectProposer))
    assert [o.token_ids for o in spec] == [reference_greedy(MODEL, p, max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("speculative", [NGRAM, PERFECT], ids=["ngram", "perfect"])
def test_context_limit_is_never_passed(speculative):
    model = FakeCausalLM(vocab_size=12, max_model_len=16)
    perfect = type("PerfectForShortContext", (PerfectProposer,), {"model": model})
    engine = fake_engine(model, speculative=speculative, registry=registry_with(perfect))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].finish_reason == "length" and len(PROMPTS[0]) + len(out[0].token_ids) == 17


def test_stop_token_inside_an_accepted_run_cuts_the_output_there():
    expected = reference_greedy(MODEL, DIVERSE, 24)
    assert expected.index(2) == 4
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[2])
    [spec], engine = run(PERFECT, prompts=[DIVERSE], params=params, registry=registry_with(PerfectProposer))
    assert spec.token_ids == expected[:5] and spec.finish_reason == "stop" and spec.outputs[0].stop_reason == 2
    # The second step accepted all eight drafts; the output ends inside that run.
    assert engine.metrics()["spec_accepted_tokens"] == 8 and engine.metrics()["steps"] == 2


def test_rejected_drafts_give_their_blocks_back_and_only_accepted_blocks_are_cached():
    class Wrong(SpeculativeProposer):
        name = "wrong"

        def propose(self, requests, num_tokens):  # never the greedy token: always rejected
            return [DraftProposal([(reference_greedy(MODEL, list(r.token_ids), 1)[0] + 1) % 12] * num_tokens)
                    for r in requests]

    engine = fake_engine(MODEL, speculative={"proposer": "wrong", "num_tokens": 8}, registry=registry_with(Wrong),
                         block_size=4)
    prompt = PROMPTS[0][:7]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.step()  # prefill: 8 tokens known, 7 computed
    engine.step()  # decode + 8 wrong drafts need 4 blocks; all rejected: back to 8 computed, 2 blocks
    request = engine.scheduler.running[0]
    assert request.num_computed_tokens == 8 and len(request.output_token_ids) == 2
    assert engine.kv.block_table("a") == engine.kv.block_table("a")[:2] and engine.kv.capacity("a") == 8
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].token_ids == reference_greedy(MODEL, prompt, 12)
    # The prefix cache holds exactly the full blocks of the accepted (and computed) tokens ...
    full = prompt + out[0].token_ids
    assert engine.kv.usage().cached == (len(full) - 1) // 4
    # ... and what they hold is right: a request reusing them continues exactly.
    engine.add_request("b", full, SamplingParams(temperature=0, max_tokens=6))
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].token_ids == reference_greedy(MODEL, full, 6) and engine.metrics()["prefix_cache_hit_rate"] > 0


def test_opted_out_and_crowded_requests_do_not_speculate():
    params = SamplingParams(temperature=0, max_tokens=12, speculative=False)
    _, engine = run(NGRAM, params=params)
    assert engine.metrics()["spec_draft_tokens"] == 0
    _, engine = run({**NGRAM, "disable_above_batch_size": 3})  # four requests run at first
    crowded = engine.metrics()["spec_draft_tokens"]
    _, engine = run({**NGRAM, "disable_above_batch_size": 4})
    assert 0 <= crowded < engine.metrics()["spec_draft_tokens"]


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    first, engine = run(NGRAM, params=params)
    second, _ = run(NGRAM, params=params, seed=9)  # another engine seed: seeded requests ignore it
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert engine.metrics()["spec_draft_tokens"] > 0


class Broken(SpeculativeProposer):
    mode = ""

    def propose(self, requests, num_tokens):
        if self.mode == "count":
            return [DraftProposal([1])] * (len(requests) + 1)
        if self.mode == "long":
            return [DraftProposal([1] * (num_tokens + 1)) for _ in requests]
        return [DraftProposal([1, 12]) for _ in requests]  # 12 is outside the vocabulary


@pytest.mark.parametrize("mode, message", [
    ("oov", r"proposed token ids \[12\] .* vocabulary \[0, 12\)"),
    ("count", "returned 2 proposals for 1 requests"),
    ("long", "proposed 5 tokens .* more than the 4 asked"),
])
def test_contract_breaking_proposer_is_refused_by_name_and_the_request_is_untouched(mode, message):
    cls = type(f"Broken{mode}", (Broken,), {"name": f"broken-{mode}", "mode": mode})
    engine = fake_engine(MODEL, speculative={"proposer": cls.name, "num_tokens": 4}, registry=registry_with(cls))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # prefill: nothing is proposed yet
    request = engine.scheduler.running[0]
    before = (list(request.output_token_ids), request.num_computed_tokens, engine.kv.block_table("a"))
    with pytest.raises(ProposerError, match=f"proposer 'broken-{mode}' {message}"):
        engine.step()
    assert (list(request.output_token_ids), request.num_computed_tokens, engine.kv.block_table("a")) == before
    engine.abort_request("a")
    assert engine.kv.usage().in_use == 0


def test_stop_string_inside_an_accepted_run_cuts_the_text_there():
    from engine_fakes import FakeTokenizer

    expected = reference_greedy(MODEL, DIVERSE, 24)
    text = FakeTokenizer().decode(expected)
    stop = "kc"  # tokens 10, 2: completed by the fifth token, inside the first accepted run
    assert text.index(stop) == 3
    engine = fake_engine(MODEL, speculative=PERFECT, tokenizer=FakeTokenizer(), registry=registry_with(PerfectProposer))
    engine.add_request("a", DIVERSE, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    while engine.has_unfinished_requests():
        [out] = engine.step()
    assert out.finish_reason == "stop" and out.text == text[:3] and out.token_ids == expected[:5]
    assert engine.metrics()["spec_accepted_tokens"] == 8


def test_abort_while_speculating_frees_every_block_and_the_proposers_state():
    engine = fake_engine(MODEL, speculative=NGRAM)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    proposer = engine.drafter.proposer
    assert engine.metrics()["spec_draft_tokens"] > 0 and set(proposer.histories) == {"a", "a#1"}
    engine.abort_request("a")
    assert engine.kv.usage().in_use == 0 and proposer.histories == {}
