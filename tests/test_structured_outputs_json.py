"""kvforge-tiny, which alone writes code-like noise, writes JSON that parses and
validates against the schema it is given (the built-in backend `auto` picks),
greedy and sampled, n > 1, with n-gram and draft-model speculation equal to without, and a regex
fully matched."""

from __future__ import annotations

import json
import re

import pytest

from kvforge import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["def main(", "A person as JSON: ", "the cat sat on the mat. the cat sat on the"]
COMMON = {"device": "cpu", "dtype": "float32", "cache": {"block_size": 8, "num_blocks": 128}}


@pytest.fixture(scope="module")
def llm():
    return LLM("kvforge-tiny", **COMMON)


def json_params(**params) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), max_tokens=200, **params)


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3, n=3)],
                         ids=["greedy", "sampled"])
def test_every_output_parses_and_validates(llm, params):
    for output in llm.generate(PROMPTS, json_params(**params)):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), SCHEMA)


@pytest.mark.parametrize("speculative", [
    {"proposer": "ngram", "num_tokens": 4},
    {"proposer": "draft_model", "num_tokens": 4, "options": {"model": "kvforge-tiny-draft", "num_blocks": 64}},
], ids=["ngram", "draft_model"])
def test_speculation_gives_the_same_greedy_json(llm, speculative):
    spec, plain = LLM("kvforge-tiny", speculative=speculative, **COMMON), llm
    prompts = ['{"name": "ab", "age": 1} {"name": "ab", "age": 1} {"name": "ab", "age": 1} ', *PROMPTS]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, json_params(temperature=0))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, json_params(temperature=0))] == expected
    assert spec.engine.metrics()["spec_draft_tokens"] > 0


def test_a_regex_is_fully_matched(llm):
    pattern = r"[a-z]{2,5}-[0-9]{3}"
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern), max_tokens=40,
                            temperature=1.0, seed=1, n=4)
    for output in llm.generate(PROMPTS, params):
        assert all(re.fullmatch(pattern, s.text) and s.finish_reason == "stop" for s in output.outputs)


def test_a_schema_the_backend_cannot_compile_ends_only_its_request(llm):
    broken = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    outputs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=20, structured_outputs=broken),
                                         json_params(temperature=0)])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert "could not be compiled by 'xgrammar'" in outputs[0].error and "$defs" in outputs[0].error
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), SCHEMA)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_llm_takes_the_backend_by_name(backend):
    pytest.importorskip(backend)
    llm = LLM("kvforge-tiny", structured_outputs={"backend": backend}, **COMMON)
    assert llm.engine.config.structured_outputs.backend == backend
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["up", "down"]))
    assert llm.generate(PROMPTS[:1], params)[0].text in ("up", "down")
    assert [b.name for b in llm.engine.structured_outputs.backends.values()] == [backend]
