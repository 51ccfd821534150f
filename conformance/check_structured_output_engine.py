"""Conformance of every `structured_output` backend through the reference engine:
kvforge-tiny, which alone writes code-like noise, writes JSON its schema validates.

The model runs over every JSON schema of the corpus the backend compiles (under
--quick a seeded sample of them), all in one batch, compact (the default layout),
each request with `close_within_max_tokens` (the engine closes a document the
model keeps open, such as the digits of an unbounded number, near the end of
`max_tokens`):

* Every output ends on EOS ("stop") within `max_tokens`, parses and validates
  (the `jsonschema` package judges), is a sequence a fresh grammar of the spec
  accepts, and has no whitespace outside a JSON string.
* Greedy: with ngram and draft_model speculation, and with preemption forced by a
  small KV cache, every output is token-for-token the plain greedy one.
* Sampled (a seed per request): the same properties, plain, with draft_model
  speculation and under preemption.

A backend that compiles none of the corpus's JSON schemas is not applicable; one
that cannot be built over kvforge-tiny's vocabulary is skipped with its reason.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from kvforge.core import STRUCTURED_OUTPUT, EngineConfig
from kvforge.core.structured_output import JSON
from kvforge.engine.llm import LLM
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.structured_outputs_params import StructuredOutputsParams

from .applicability import not_applicable
from .check_structured_output import OPTIONS_ENV, QUICK_CASES, backend, seed
from .selection import quick, registry
from .structured_corpus import TINY, Case, corpus
from .structured_walks import whitespace_outside_strings

KIND = STRUCTURED_OUTPUT
GROUP = "engine"
HEAVY = True  # runs after the grammar walks: a broken backend fails those in seconds
MAX_TOKENS = 256
"""Room enough that most outputs end by themselves: the engine closes only the ones
kvforge-tiny keeps extending (a number's digits, an open object's keys)."""
PREEMPTING_BLOCKS = 64
"""A KV cache of 64 blocks of 8 tokens: the whole batch does not fit, so running requests are preempted."""
DRAFT_MODEL = {"proposer": "draft_model", "num_tokens": 4,
               "options": {"model": "kvforge-tiny-draft", "num_blocks": 2048}}
SETTINGS = {
    "plain": {},
    "ngram": {"speculative": {"proposer": "ngram", "num_tokens": 4}},
    "draft_model": {"speculative": DRAFT_MODEL},
    "preemption": {"cache": {"block_size": 8, "num_blocks": PREEMPTING_BLOCKS}},
}


def json_cases(registration) -> list[Case]:
    """The corpus's JSON schemas the backend compiles; under --quick a seeded sample of them."""
    instance = backend(registration, "kvforge-tiny")
    cases = [case for case in corpus() if case.spec.kind == JSON and not instance.spec_unsupported_reasons(case.spec)]
    if not cases:
        not_applicable(f"{registration.name} compiles none of the corpus's JSON schemas")
    if quick() and len(cases) > QUICK_CASES:
        cases = random.Random(seed()).sample(cases, QUICK_CASES)
    return cases


def run(name: str, setting: str, cases: list[Case], temperature: float):
    """(outputs, engine metrics) of one batch: every case once, prompted with its name."""
    options = json.loads(os.environ.get(OPTIONS_ENV) or "{}").get(name, {})
    config = {"model": "kvforge-tiny", "device": "cpu", "dtype": "float32",
              "cache": {"block_size": 8, "num_blocks": 2048}, "scheduler": {"max_num_seqs": 256},
              "structured_outputs": {"backend": name, "options": options}, **SETTINGS[setting]}
    engine = LLMEngine(EngineConfig(**config), registry=registry())
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(json=case.spec.value,
                                                                        close_within_max_tokens=True),
                             max_tokens=MAX_TOKENS, temperature=temperature, seed=i) for i, case in enumerate(cases)]
    outputs = LLM.from_engine(engine).generate([f"{case.name}: " for case in cases], params)
    return outputs, engine.metrics()


def check_outputs(registration, setting: str, cases: list[Case], outputs) -> None:
    """Every output ends on EOS within `MAX_TOKENS`, is accepted by a fresh grammar,
    has no whitespace outside strings, and validates."""
    name = registration.name
    grammars = backend(registration, "kvforge-tiny")
    eos = set(TINY.eos_token_ids)
    for case, output in zip(cases, outputs):
        sample = output.outputs[0]
        where = f"{name} ({setting}) on {case.name!r}: {sample.text[:120]!r}"
        assert not output.error, f"{where} ended with {sample.finish_reason!r}: {output.error}"
        tokens = [t for t in sample.token_ids if t not in eos]
        assert grammars.compile(case.spec).accept_tokens(tokens), \
            f"{where}: a fresh grammar of the spec refuses the output (the engine let a masked token through)"
        assert whitespace_outside_strings(sample.text) is None, f"{where}: whitespace outside a string in compact JSON"
        assert sample.finish_reason == "stop" and len(sample.token_ids) <= MAX_TOKENS, \
            (f"{where} ended {sample.finish_reason!r} after {len(sample.token_ids)} tokens: close_within_max_tokens "
             f"did not close it within {MAX_TOKENS} (...{sample.text[-60:]!r})")
        assert case.accepts(sample.text), f"{where}: finished, but it does not parse and validate"


_plain_greedy: dict[tuple[str, int], list[list[int]]] = {}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_outputs_validate_and_speculation_and_preemption_change_none(registration, setting):
    cases = json_cases(registration)
    outputs, metrics = run(registration.name, setting, cases, temperature=0.0)
    check_outputs(registration, setting, cases, outputs)
    tokens = [output.outputs[0].token_ids for output in outputs]
    key = (registration.name, seed())
    if setting == "plain":
        _plain_greedy[key] = tokens
        return
    plain = _plain_greedy.get(key) or [o.outputs[0].token_ids for o in run(registration.name, "plain", cases, 0.0)[0]]
    differ = [case.name for case, got, want in zip(cases, tokens, plain) if got != want]
    assert not differ, f"{registration.name} with {setting} writes other greedy output than without for {differ[:5]}"
    if setting == "preemption":
        assert metrics["preemptions"] > 0, "no request was preempted: the check proves nothing"
    else:
        assert metrics["spec_draft_tokens"] > 0, f"{setting} proposed nothing: the check proves nothing"


@pytest.mark.parametrize("setting", ["plain", "draft_model", "preemption"])
def test_sampled_outputs_validate(registration, setting):
    cases = json_cases(registration)
    outputs, metrics = run(registration.name, setting, cases, temperature=1.0)
    check_outputs(registration, setting, cases, outputs)
    if setting == "preemption":
        assert metrics["preemptions"] > 0, "no request was preempted: the check proves nothing"
