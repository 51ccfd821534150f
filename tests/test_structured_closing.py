"""The closing policy (engine/structured_closing.py) over the conformance corpus, and
`close_within_max_tokens` through the engine on kvforge-tiny.

The policy: from random valid prefixes of every JSON, regex and choice spec of the
corpus, over the byte-level and the multi-byte vocabulary, the closing path ends
on EOS, the finished text is a right output for the spec, and the grammar is left
as it was; the rest of a path is the path from after its first token (what lets the
engine follow a path, and speculation and preemption see the same masks). A planted
policy that never closes is caught by the same check.

The engine: a budget of just the closing path still ends on EOS and validates; the
number kvforge-tiny never ends is cut ("length") without the option and closed
("stop") with it; draft-model speculation across the closing point changes no greedy
token; the conformance engine group catches an engine that never closes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.conformance.check_structured_output_engine import DRAFT_MODEL
from kvforge.conformance.structured_corpus import VOCABULARIES, corpus
from kvforge.conformance.structured_walks import allowed_ids
from kvforge.core import build_registry, load_config
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.structured_closing import ClosingPolicy
from kvforge.engine.structured_outputs_params import StructuredOutputsParams

xgrammar_backend = pytest.importorskip("kvforge.plugins.structured_output.xgrammar_backend")
pytest.importorskip("xgrammar")
PREFIXES = 2  # random prefixes per spec, besides the empty one
LIMIT = 400  # a path longer than this does not end


def random_prefix(backend, grammar, rng: random.Random, length: int) -> list[int]:
    """Up to `length` random tokens `grammar` allows (EOS never), accepted into it."""
    eos = set(backend.vocabulary.eos_token_ids)
    tokens: list[int] = []
    for _ in range(length):
        row = backend.allocate_bitmask(1)
        grammar.fill_bitmask(row, 0)
        ids = [i for i in allowed_ids(row[0]) if i not in eos]
        if not ids:
            break
        tokens.append(rng.choice(ids))
        assert grammar.accept_tokens(tokens[-1:])
    return tokens


def closing_failures(policy: ClosingPolicy, backend, cases, seed: int = 0) -> list[str]:
    """Every way `policy` fails `cases`: no path, a wrong document, a grammar not left
    as it was, a path whose rest is not the path from after its first token."""
    rng, failures = random.Random(seed), []
    vocabulary = backend.vocabulary
    for case in cases:
        grammar = backend.compile(case.spec)
        for trial in range(1 + PREFIXES):
            prefix = random_prefix(backend, grammar, rng, 0 if trial == 0 else rng.randrange(1, 40))
            before = backend.allocate_bitmask(1)
            grammar.fill_bitmask(before, 0)
            path = policy.path(grammar, prefix, LIMIT)
            after = backend.allocate_bitmask(1)
            grammar.fill_bitmask(after, 0)
            text = b"".join(vocabulary.token_bytes[t] for t in prefix + (path or [])[:-1])
            where = f"{case.name} after {text[:80]!r}"
            if not torch.equal(before, after) or grammar.is_terminated():
                failures.append(f"{where}: the grammar was not left as it was")
            elif path is None or path[-1] not in vocabulary.eos_token_ids:
                failures.append(f"{where}: no closing path within {LIMIT} tokens")
            elif not case.accepts(text.decode("utf-8", "replace")):
                failures.append(f"{where}: the closed output is wrong for the spec")
            elif len(path) > 1:
                assert grammar.accept_tokens(path[:1])
                rest = policy.path(grammar, prefix + path[:1], LIMIT)
                grammar.rollback(1)
                if rest != path[1:]:
                    failures.append(f"{where}: the path after its first token is {rest}, not {path[1:]}")
            grammar.rollback(len(prefix))
    return failures


@pytest.mark.parametrize("vocabulary", list(VOCABULARIES))
def test_closing_path_finishes_every_spec_of_the_corpus_from_random_prefixes(vocabulary):
    backend = xgrammar_backend.XgrammarBackend(VOCABULARIES[vocabulary])
    cases = [case for case in corpus() if not backend.spec_unsupported_reasons(case.spec)]
    assert len(cases) > 150
    failures = closing_failures(ClosingPolicy(backend.vocabulary), backend, cases)
    assert not failures, f"{len(failures)} failures, e.g. {failures[:5]}"


class NeverClosing(ClosingPolicy):
    """Planted: prefers digits and letters to what closes (a number or string never ends)."""

    def __init__(self, vocabulary):
        super().__init__(vocabulary)
        self.num_first = 0
        self._set_candidates(self.candidates[::-1])


def test_a_policy_that_never_closes_is_caught():
    backend = xgrammar_backend.XgrammarBackend(VOCABULARIES["kvforge-tiny"])
    cases = [case for case in corpus() if case.name in ("integer/alone", "string/required_field", "person")]
    failures = closing_failures(NeverClosing(backend.vocabulary), backend, cases)
    assert any("no closing path" in f for f in failures), failures[:5]


# Through the engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
NUMBER = {"type": "integer"}  # kvforge-tiny writes its digits until max_tokens


@pytest.fixture(scope="module")
def llm():
    config = load_config(None, model="kvforge-tiny", device="cpu", dtype="float32",
                         cache={"block_size": 8, "num_blocks": 256},
                         structured_outputs={"backend": "xgrammar"}).config
    return LLM.from_engine(LLMEngine(config, registry=build_registry()))


def params(schema, max_tokens: int, close: bool, **more) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, close_within_max_tokens=close),
                          max_tokens=max_tokens, **more)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_budget_of_just_the_closing_path_still_closes_the_document(llm, temperature):
    backend = xgrammar_backend.XgrammarBackend(VOCABULARIES["kvforge-tiny"])
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMA).spec())
    budget = len(ClosingPolicy(backend.vocabulary).path(grammar, [], LIMIT))  # forced from the first token
    prompts = ["person: ", "def main(", "0000000000"]
    outputs = llm.generate(prompts, params(SCHEMA, budget, True, temperature=temperature, seed=3))
    for output in outputs:
        sample = output.outputs[0]
        assert sample.finish_reason == "stop" and len(sample.token_ids) <= budget, (sample.finish_reason, sample.text)
        document = json.loads(sample.text)
        assert set(document) == {"name", "age", "tags"} and isinstance(document["age"], int)


def test_the_number_kvforge_tiny_never_ends_is_closed_only_when_asked(llm):
    prompt = ["integer/alone: "]
    cut = llm.generate(prompt, params(NUMBER, 40, False, temperature=0))[0].outputs[0]
    closed = llm.generate(prompt, params(NUMBER, 40, True, temperature=0))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 40, "the check needs an output max_tokens cuts"
    assert closed.finish_reason == "stop" and len(closed.token_ids) <= 40
    assert int(closed.text) is not None and cut.text.startswith(closed.text)
    assert llm.engine.metrics()["structured_closing_forced_rows"] > 0


def test_speculation_drafting_across_the_closing_point_changes_no_greedy_token(llm):
    # kvforge-tiny writes the digits of these objects' numbers until the path is forced
    # and its draft model drafts the run of zeros past that point: every row after a draft
    # token is forced as plain decoding's would be, and a rejected draft leaves no path behind
    config = load_config(None, model="kvforge-tiny", device="cpu", dtype="float32",
                         cache={"block_size": 8, "num_blocks": 256}, structured_outputs={"backend": "xgrammar"},
                         speculative=DRAFT_MODEL).config
    speculating = LLM.from_engine(LLMEngine(config, registry=build_registry()))
    cases = [case for case in corpus() if case.name in ("nested/depth1", "object/all_required[3]", "integer/alone")]
    prompts = [f"{case.name}: " for case in cases]  # as the conformance group prompts them
    batch = [params(case.spec.value, 256, True, temperature=0) for case in cases]
    plain, drafted = llm.generate(prompts, batch), speculating.generate(prompts, batch)
    for case, want, got in zip(cases, plain, drafted):
        assert not got.error and got.outputs[0].token_ids == want.outputs[0].token_ids, (case.name, got.error)
        assert got.outputs[0].finish_reason == "stop" and case.accepts(got.outputs[0].text)
    assert speculating.engine.metrics()["spec_draft_tokens"] > 0
    assert llm.engine.metrics()["structured_closing_forced_rows"] > 0, "nothing was closed: the test proves nothing"


def test_close_within_max_tokens_is_a_boolean_and_reachable_from_a_request_body():
    parsed = StructuredOutputsParams.from_dict({"json": NUMBER, "close_within_max_tokens": True})
    assert parsed.close_within_max_tokens and parsed.spec() == StructuredOutputsParams(json=NUMBER).spec()
    with pytest.raises(Exception, match="close_within_max_tokens must be True or False"):
        StructuredOutputsParams(json=NUMBER, close_within_max_tokens="yes")
    from kvforge.serving.structured_protocol import StructuredOutputsBody, structured_params

    body = StructuredOutputsBody.model_validate({"json": NUMBER, "close_within_max_tokens": True})
    assert structured_params(None, body) == parsed


def test_the_conformance_engine_group_catches_an_engine_that_never_closes(monkeypatch):
    from kvforge.conformance import check_structured_output_engine as engine_check
    from kvforge.conformance.attention_cases import SEED_ENV
    from kvforge.conformance.selection import QUICK_ENV
    from kvforge.core import STRUCTURED_OUTPUT
    from kvforge.engine.structured_closing import Closer

    monkeypatch.setenv(QUICK_ENV, "1")  # a seeded sample of the corpus's JSON schemas, with some kept open
    monkeypatch.setenv(SEED_ENV, "0")
    monkeypatch.setattr(Closer, "forced_token", lambda self, request, grammar, draft: None)
    registration = build_registry().get(STRUCTURED_OUTPUT, "xgrammar")
    with pytest.raises(AssertionError, match="ended 'length' after 256 tokens: close_within_max_tokens did not close"):
        engine_check.test_sampled_outputs_validate(registration, "plain")
