"""Structured outputs through the engine on kvforge-tiny (a real byte-level Llama
that left alone writes code-like noise), with the test-local `choice` trie
backend (tests/structured_backends.py): every output is one of the choices,
greedy and sampled, for n > 1 samples, under preemption and with speculation;
a spec that fails or hangs in compilation ends only its own request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.core import RequestError, build_registry, load_config
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.structured_outputs_params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent))
import structured_backends  # noqa: E402
from structured_backends import ChoiceGrammar, HangingChoiceBackend  # noqa: E402

CHOICES = ["yes", "no", "maybe so", "maybe not"]
PROMPTS = ["Is the sky blue? Answer: ", "def main(", "the cat sat on the mat. the cat sat on the"]


def structured_llm(**sections) -> LLM:
    registry = build_registry()
    registry.register_plugin(structured_backends.plugin(), "test-structured")
    config = load_config(None, model="kvforge-tiny", device="cpu", dtype="float32",
                         **{"cache": {"block_size": 8, "num_blocks": 64}, **sections}).config
    return LLM.from_engine(LLMEngine(config, registry=registry))


@pytest.fixture(scope="module")
def llm():
    return structured_llm()


def choice(*options, **params) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(choice=list(options or CHOICES)), **params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_sample_is_one_of_the_choices_and_ends_with_eos(llm, temperature):
    params = choice(temperature=temperature, max_tokens=40, n=3, seed=5)
    outputs = llm.generate(PROMPTS, params)
    eos = llm.engine.eos_token_id
    for output in outputs:
        for sample in output.outputs:
            assert sample.text in CHOICES and sample.finish_reason == "stop"
            assert sample.token_ids[-1] == eos and bytes(sample.token_ids[:-1]).decode() == sample.text


def test_unconstrained_output_of_the_same_prompts_is_not_a_choice(llm):
    # (the model alone does not happen to write a choice: the grammar does the work above)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert all(o.outputs[0].text not in CHOICES for o in outputs)


def test_seeded_sampling_repeats_and_samples_differ(llm):
    params = choice(temperature=1.5, max_tokens=40, n=6, seed=11)
    first = [[s.text for s in o.outputs] for o in llm.generate(PROMPTS, params)]
    assert first == [[s.text for s in o.outputs] for o in llm.generate(PROMPTS, params)]
    assert any(len(set(texts)) > 1 for texts in first)


def test_max_tokens_cuts_an_unfinished_choice_with_length(llm):
    output = llm.generate(PROMPTS[:1], choice("maybe so", temperature=0, max_tokens=3))[0].outputs[0]
    assert output.text == "may" and output.finish_reason == "length"


def test_preemption_keeps_each_grammar_where_its_output_is():
    alone = structured_llm()
    # All three start (their prompts fit), then their outputs outgrow the cache together.
    reason = ", and here is a long reason why it is so"
    params = choice("the answer is certainly yes" + reason, "the answer is certainly no" + reason,
                    temperature=0, max_tokens=80)
    prompts = PROMPTS
    expected = [o.outputs[0].text for o in alone.generate(prompts, params)]
    tight = structured_llm(cache={"block_size": 8, "num_blocks": 20})
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0, "no preemption: the test proves nothing"
    assert got == expected and all(t.startswith("the answer is certainly") for t in got)


def test_speculation_gives_the_same_greedy_structured_output_and_drafts_are_cut():
    plain, spec = structured_llm(), structured_llm(speculative={"proposer": "ngram", "num_tokens": 4})
    # The prompt repeats itself, so n-gram drafts continue it; only some continuations are choices.
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the",
               "yes no yes no yes no yes no"]
    params = choice(" mat. the cat sat on the mat.", " mat. the dog", " no yes no", " yes no yes no",
                    temperature=0, max_tokens=40)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == expected
    metrics = spec.engine.metrics()
    assert metrics["spec_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"
    assert metrics["structured_draft_tokens_cut"] > 0, "no draft broke the grammar: the test proves nothing"


def test_multi_step_decoding_never_bursts_a_grammar_and_bursts_once_it_ends():
    # A grammar request beside a plain one: every step is scheduled while the grammar runs,
    # and the plain request's steps burst once the grammar request has ended.
    plain, bursting = (structured_llm(scheduler={"num_scheduler_steps": 1}),
                       structured_llm(scheduler={"num_scheduler_steps": 6, "max_burst_s": 60.0}))
    prompts = ["Is the sky blue? Answer: ", "def main("]
    params = [choice(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in bursting.generate(prompts, params)]
    assert got == expected
    assert tokenizer_text(plain, expected[0]) in CHOICES
    steps = bursting.engine.metrics()["steps"]
    assert len(expected[0]) < steps < plain.engine.metrics()["steps"]


def tokenizer_text(llm, token_ids: list[int]) -> str:
    return llm.engine.tokenizer.decode([t for t in token_ids if t != llm.engine.eos_token_id])


def test_a_spec_that_fails_to_compile_ends_only_its_request(llm):
    outputs = llm.generate(PROMPTS[:2], [choice("", "x", temperature=0), choice(temperature=0, max_tokens=40)])
    bad, good = outputs[0].outputs[0], outputs[1].outputs[0]
    assert bad.finish_reason == "error" and "must not be empty" in outputs[0].error
    assert "test-choice-trie" in outputs[0].error
    assert good.finish_reason == "stop" and good.text in CHOICES
    # the failure is remembered: the same spec fails at once, without compiling again
    compiles = llm.engine.structured_outputs.stats.compile_count
    assert llm.generate(PROMPTS[:1], choice("", "x"))[0].outputs[0].finish_reason == "error"
    assert llm.engine.structured_outputs.stats.compile_count == compiles


def test_a_compile_past_the_time_limit_ends_only_its_request():
    llm = structured_llm(structured_outputs={"backend": HangingChoiceBackend.name, "compile_timeout_s": 0.2})
    HangingChoiceBackend.release.clear()
    try:
        outputs = llm.generate(PROMPTS[:2], [choice("hang", "x", temperature=0), choice(temperature=0, max_tokens=40)])
    finally:
        HangingChoiceBackend.release.set()
    assert outputs[0].outputs[0].finish_reason == "error" and "compile_timeout_s = 0.2" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "stop" and outputs[1].outputs[0].text in CHOICES
    llm.engine.shutdown()


def test_a_spec_the_backend_cannot_compile_is_refused_when_added_naming_why():
    llm = structured_llm(structured_outputs={"backend": structured_backends.ChoiceTrieBackend.name})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    with pytest.raises(RequestError, match="test-choice-trie does not compile 'regex' specs"):
        llm.engine.add_request("r", "hello", params)
    assert not llm.engine.has_unfinished_requests()


def test_metrics_count_compiles_and_masks(llm):
    llm.generate(PROMPTS[:1], choice(temperature=0, max_tokens=40))
    metrics = llm.engine.metrics()
    assert metrics["structured_compiles"] >= 1 and metrics["structured_mask_steps"] >= 1
    assert metrics["structured_waiting_for_grammar"] == 0


def test_each_verified_position_gets_the_mask_of_its_draft_prefix_and_the_grammar_is_rolled_back(llm):
    from kvforge.engine.structured_outputs import StructuredOutputs

    vocabulary = llm.engine.structured_outputs.vocabulary
    grammar = ChoiceGrammar((b"abc",), vocabulary)

    class Pending:
        request_id, grammar_backend = "r", structured_backends.ChoiceTrieBackend(vocabulary)

    request = Pending()
    request.grammar = grammar
    logits = torch.zeros(3, vocabulary.vocab_size)
    StructuredOutputs(None, lambda: vocabulary).mask(logits, [request], [[ord("a"), ord("b")]])
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[ord("a")], [ord("b")], [ord("c")]]
    assert grammar.tokens == []  # rolled back after the tentative advance


def test_no_penalty_brings_back_a_token_the_grammar_forbids(llm):
    # a repetition penalty below float32's range is 0 there: -inf * 0 would be NaN, which
    # argmax takes; the grammar's mask comes after the penalties, so it cannot
    params = choice("yes", "no", temperature=0, max_tokens=8, repetition_penalty=5e-324, presence_penalty=2.0)
    output = llm.generate(["yes no yes no maybe"], params)[0].outputs[0]
    assert output.finish_reason == "stop" and output.text in ("yes", "no")


def test_a_penalty_beyond_float32_on_every_allowed_token_still_samples_inside_the_grammar(llm):
    # 1.4e308 is inf in float32: every seen token with a negative logit would become -inf,
    # and a row whose allowed tokens are all -inf has no allowed argmax
    prompt = "".join(map(chr, range(32, 127))) * 2 + '{ } \n\t"0123'
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.4e308,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    output = llm.generate([prompt], params)[0].outputs[0]
    assert output.finish_reason in ("stop", "length") and output.text.startswith("{"), output


def test_a_temperature_too_small_for_float32_samples_greedily_inside_the_grammar(llm):
    # 1e-75 is 0 in float32: dividing by it would give infinities and NaN probabilities
    tiny = llm.generate(PROMPTS, choice(temperature=1e-75, max_tokens=40))
    greedy = llm.generate(PROMPTS, choice(temperature=0, max_tokens=40))
    assert [o.outputs[0].text for o in tiny] == [o.outputs[0].text for o in greedy]


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once():
    llm = structured_llm(structured_outputs={"backend": HangingChoiceBackend.name})
    HangingChoiceBackend.release.clear()
    engine = llm.engine
    try:
        engine.add_request("waits", "x", choice("hang", "x"))
        engine.step()
        assert engine.metrics()["structured_waiting_for_grammar"] == 1
        output = engine.abort_request("waits")
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    finally:
        HangingChoiceBackend.release.set()
        engine.shutdown()


NEVER_RETURNS = """
import sys, threading
sys.path.insert(0, {tests!r})
import structured_backends
from kvforge import LLM, SamplingParams
from kvforge.core import build_registry, load_config
from kvforge.engine.llm_engine import LLMEngine

class Stuck(structured_backends.ChoiceTrieBackend):
    name = "test-stuck"
    def compile(self, spec):
        threading.Event().wait()  # never returns, as a grammar library stuck on a schema

registry = build_registry()
registry.register_plugin(structured_backends.plugin(Stuck), "test-stuck")
config = load_config(None, model="kvforge-tiny", device="cpu", dtype="float32",
                     structured_outputs={{"backend": "test-stuck", "compile_timeout_s": 0.1}}).config
llm = LLM.from_engine(LLMEngine(config, registry=registry))
params = SamplingParams(structured_outputs={{"choice": ["a"]}})
print(llm.generate(["x"], params)[0].outputs[0].finish_reason)
"""


def test_a_compile_that_never_returns_ends_its_request_and_the_process_still_exits():
    import subprocess

    script = NEVER_RETURNS.format(tests=str(Path(__file__).parent))
    # (a pool whose threads the interpreter joins at exit would hang here until the timeout)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "error"
