"""Structured outputs through the OpenAI API, in process (kvforge-tiny, the test-local
`choice` trie backend): `structured_outputs` in the body (the OpenAI client's
`extra_body`) and `response_format` reach the engine; bad specs are 400s naming
the problem; a spec that fails to compile does not take the server down."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvforge.core import build_registry, load_config  # noqa: E402
from kvforge.engine.llm_engine import LLMEngine  # noqa: E402
from kvforge.serving.app import build_app  # noqa: E402
from kvforge.serving.openai_api import ServeSettings  # noqa: E402
from kvforge.serving.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import structured_backends  # noqa: E402

MODEL = "kvforge-tiny"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def client():
    registry = build_registry()
    registry.register_plugin(structured_backends.plugin(), "test-structured")
    config = load_config(None, model=MODEL, device="cpu", dtype="float32",
                         cache={"block_size": 8, "num_blocks": 64},
                         structured_outputs={"backend": structured_backends.ChoiceTrieBackend.name}).config
    app = build_app(LLMEngine(config, registry=registry), ServeSettings(model_name=MODEL))
    with TestClient(app) as client:
        yield client


def test_structured_outputs_choice_constrains_completions_and_chat(client):
    body = {"model": MODEL, "max_tokens": 20, "temperature": 0, "n": 2, "structured_outputs": {"choice": CHOICES}}
    response = client.post("/v1/completions", json={**body, "prompt": "def main("})
    assert response.status_code == 200, response.text
    assert all(c["text"] in CHOICES and c["finish_reason"] == "stop" for c in response.json()["choices"])
    response = client.post("/v1/chat/completions",
                           json={**body, "messages": [{"role": "user", "content": "Pick a colour"}]})
    assert response.status_code == 200, response.text
    assert all(c["message"]["content"] in CHOICES for c in response.json()["choices"])


def test_response_format_and_structured_outputs_become_the_engines_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}})
    spec = chat.sampling_params(8, None).structured_outputs.spec()
    assert spec.kind == "json" and '"required":["a"]' in spec.value
    completion = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert completion.sampling_params(8, None).structured_outputs.spec().kind == "json_object"
    plain = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert plain.sampling_params(8, None).structured_outputs is None
    regex = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}})
    assert regex.sampling_params(8, None).structured_outputs.spec().value == "[0-9]+"
    assert not chat.sampling_params(8, None).structured_outputs.spec().any_whitespace  # JSON is compact
    flexible = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": schema,
                                                                                       "any_whitespace": True}})
    assert flexible.sampling_params(8, None).structured_outputs.spec().any_whitespace


@pytest.mark.parametrize("extra, named", [
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "not a valid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "not a valid regular expression"),
    ({"structured_outputs": {"choice": CHOICES, "regex": "a"}}, "exactly one of"),
    ({"structured_outputs": {"choice": CHOICES}, "response_format": {"type": "json_object"}}, "not both"),
    ({"structured_outputs": {"choice": CHOICES}, "ignore_eos": True}, "ignore_eos cannot be combined"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "test-choice-trie does not compile 'grammar'"),
])
def test_a_bad_spec_is_a_400_naming_the_problem(client, extra, named):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["code"] == "invalid_structured_output"


def test_response_format_json_schema_without_its_schema_is_refused_by_the_request_schema(client):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "response_format": {"type": "json_schema"}})
    assert response.status_code == 400 and "response_format.json_schema" in response.json()["error"]["message"]


def test_a_spec_that_fails_to_compile_fails_only_its_request(client):
    bad = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                                               "structured_outputs": {"choice": ["", "x"]}})
    assert bad.status_code == 400 and "must not be empty" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "structured_outputs"
    good = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0,
                                                "structured_outputs": {"choice": CHOICES}})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] in CHOICES


def test_metrics_count_grammar_compiles_and_mask_time(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0,
                                         "structured_outputs": {"choice": ["cyan", "magenta"]}})
    text = client.get("/metrics").text
    figures = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvforge:structured_output")}
    assert figures["kvforge:structured_output_compile_seconds_count"] >= 1
    assert figures["kvforge:structured_output_mask_seconds_total"] > 0
    assert figures["kvforge:structured_output_requests_waiting_for_grammar"] == 0
