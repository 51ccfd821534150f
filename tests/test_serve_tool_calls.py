"""Tool calling on chat completions, in process (kvforge-tiny, the built-in JSON
backend): a named function or "required" constrains the output to calls whose
arguments validate against the function's parameters, answered as OpenAI's
`tool_calls` (streamed too); "auto" and "none" answer content; a tool_choice that
disagrees with tools is a 400 naming it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from fastapi.testclient import TestClient  # noqa: E402

from kvforge.core import load_config  # noqa: E402
from kvforge.engine.llm_engine import LLMEngine  # noqa: E402
from kvforge.serving.app import build_app  # noqa: E402
from kvforge.serving.openai_api import ServeSettings  # noqa: E402

MODEL = "kvforge-tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# the backends allow any whitespace between JSON tokens, which the tiny model repeats; the penalty moves it on
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
        "max_tokens": 200, "temperature": 0, "frequency_penalty": 2.0}


@pytest.fixture(scope="module")
def client():
    config = load_config(None, model=MODEL, device="cpu", dtype="float32",
                         cache={"block_size": 8, "num_blocks": 128}).config
    with TestClient(build_app(LLMEngine(config), ServeSettings(model_name=MODEL))) as client:
        yield client


def check_calls(calls, names):
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for call in calls:
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_a_named_function_gets_a_call_whose_arguments_validate(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.post("/v1/chat/completions", json={**BODY, "tool_choice": choice}).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
    check_calls(reply["message"]["tool_calls"], {"get_weather"})


def test_required_without_parallel_calls_gets_one_call_to_a_known_function(client):
    body = {**BODY, "tool_choice": "required", "parallel_tool_calls": False, "n": 2, "temperature": 1.0, "seed": 4}
    for reply in client.post("/v1/chat/completions", json=body).json()["choices"]:
        assert reply["finish_reason"] == "tool_calls" and len(reply["message"]["tool_calls"]) == 1
        check_calls(reply["message"]["tool_calls"], set(SCHEMAS))


def test_parallel_tool_calls_lift_the_one_call_bound():
    from kvforge.serving.tool_calls import FunctionDefinition, calls_schema

    functions = [FunctionDefinition(name="f", parameters=TIME)]
    one, many = calls_schema(functions, parallel=False), calls_schema(functions, parallel=True)
    call = {"name": "f", "parameters": {"zone": "UTC"}}
    jsonschema.validate([call, call], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"zone": "PST"}}], many)


def test_streamed_tool_calls_arrive_as_a_tool_calls_delta(client):
    body = {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and deltas[-1]["finish_reason"] == "tool_calls"
    check_calls(calls[0], {"get_time"})


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_auto_and_none_answer_content(client, tool_choice):
    reply = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 8, "tool_choice": tool_choice}).json()
    message = reply["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message


@pytest.mark.parametrize("extra, named", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "not among tools"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "required", "structured_outputs": {"choice": ["x"]}}, "drop response_format"),
])
def test_a_tool_choice_that_disagrees_with_tools_is_a_400_naming_it(client, extra, named):
    response = client.post("/v1/chat/completions", json={**BODY, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["code"] == "invalid_tool_choice" and error["param"] == "tool_choice"


def test_a_conversation_with_a_call_and_its_result_is_accepted(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    response = client.post("/v1/chat/completions", json={**BODY, "messages": messages, "max_tokens": 4})
    assert response.status_code == 200, response.text


def test_a_chat_template_that_takes_tools_is_given_them():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvforge.serving.chat_template import chat_prompt_token_ids

    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    seen = []
    tokenizer.encode = lambda text, add_special_tokens=True: seen.append(text) or [0]
    chat_prompt_token_ids(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    chat_prompt_token_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert seen == ["[get_weather][get_time]<user>hi<assistant>", "<user>hi<assistant>"]
