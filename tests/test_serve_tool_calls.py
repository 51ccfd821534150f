"""Tool calling on chat completions, in process (kvforge-tiny, xgrammar): a named
function or "required" constrains the output to calls whose arguments validate
against the function's parameters, answered as OpenAI's `tool_calls` and streamed
as argument fragments; "auto" allows free text or `<tool_call>` blocks whose
arguments validate, and reads the calls out of the text; "none" answers content;
a tool_choice that disagrees with tools is a 400 naming it."""

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
# greedy, the tiny model repeats itself (call after call in an array) until max_tokens; the penalty moves it on
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
        "max_tokens": 200, "temperature": 0, "frequency_penalty": 2.0}


@pytest.fixture(scope="module")
def client():
    config = load_config(None, model=MODEL, device="cpu", dtype="float32",
                         cache={"block_size": 8, "num_blocks": 128}).config
    with TestClient(build_app(LLMEngine(config), ServeSettings(model_name=MODEL))) as client:
        yield client


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each tool call of an `openai` client's message, every
    call's arguments validated against its function's parameters."""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


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


def streamed_choice(client, body) -> tuple[dict, list[dict]]:
    """The stream's deltas added up into a message (and the tool-call deltas as sent)."""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    content, calls, sent = "", [], []
    for delta in deltas:
        content += delta["delta"].get("content") or ""
        for call in delta["delta"].get("tool_calls", []):
            sent.append(call)
            if "id" in call:
                assert call["index"] == len(calls)
                calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    return {"message": message, "finish_reason": deltas[-1]["finish_reason"]}, sent


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_streamed_calls_arrive_as_argument_fragments_that_add_up_to_the_answer(client, tool_choice):
    body = {**BODY, "tool_choice": tool_choice}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    streamed, sent = streamed_choice(client, body)
    assert without_ids(streamed["message"]) == without_ids(whole["message"])
    assert streamed["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert set(sent[0]) == {"index", "id", "type", "function"} and len(sent) > 2  # opened, then fragments
    check_calls(streamed["message"]["tool_calls"], set(SCHEMAS))


def test_auto_constrains_the_output_to_text_or_calls_and_none_does_not():
    from kvforge.core.structured_output import STRUCTURAL_TAG
    from kvforge.serving.protocol import ChatCompletionRequest

    def spec(**extra):
        params = ChatCompletionRequest.model_validate({**BODY, **extra}).sampling_params(8, None)
        return params.structured_outputs and params.structured_outputs.spec()

    assert spec().kind == spec(tool_choice="auto").kind == STRUCTURAL_TAG
    assert spec(tool_choice="none") is None and spec(tools=None) is None
    assert spec(response_format={"type": "json_object"}).kind == "json_object"  # the caller's constraint wins


def walk(tag: dict, text: str) -> bool:
    """Whether xgrammar, given the auto constraint, lets kvforge-tiny write `text` and end."""
    from kvforge.conformance.structured_corpus import TINY
    from kvforge.core import StructuredOutputSpec
    from kvforge.plugins.structured_output.xgrammar_backend import XgrammarBackend

    grammar = XgrammarBackend(TINY).compile(StructuredOutputSpec("structural_tag", json.dumps(tag)))
    tokens = [*text.encode(), *TINY.eos_token_ids]
    return grammar.validate_tokens(tokens) == len(tokens)


def test_the_auto_constraint_allows_text_and_valid_calls_only():
    from kvforge.serving.tool_call_format import hermes_call_text
    from kvforge.serving.tool_calls import FunctionDefinition, auto_calls_tag

    functions = [FunctionDefinition(name=t["function"]["name"], parameters=t["function"]["parameters"])
                 for t in TOOLS]
    parallel, single = auto_calls_tag(functions, parallel=True), auto_calls_tag(functions, parallel=False)
    time = hermes_call_text("get_time", '{"zone": "UTC"}')
    weather = hermes_call_text("get_weather", '{"city": "Oslo", "days": 2}')
    assert walk(parallel, "Just text, a < b.") and walk(parallel, f"Let me look. {time}")
    assert walk(parallel, f"{weather}\n{time} done") and not walk(single, f"{weather}\n{time}")
    for bad in (hermes_call_text("get_time", '{"zone": "PST"}'), hermes_call_text("get_mood", "{}"),
                hermes_call_text("get_weather", '{"city": "Oslo"}'), hermes_call_text("get_time", '{"zone":  "UTC"}'),
                time[:-1]):
        assert not walk(parallel, f"x {bad}"), bad


# The tiny model writes no `<tool_call>` of its own accord; a regex makes it write one, as a tool-calling model would.
CALL_REGEX = (r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
              r'( <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "days": [1-7]\}\}'
              r'\n</tool_call>)?')


def test_auto_reads_calls_out_of_the_text_and_streams_them_alike(client):
    body = {**BODY, "tool_choice": "auto", "structured_outputs": {"regex": CALL_REGEX}}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"].startswith("Sure. ")
    assert "<tool_call>" not in whole["message"]["content"]
    check_calls(whole["message"]["tool_calls"], set(SCHEMAS))
    streamed, _ = streamed_choice(client, body)
    assert without_ids(streamed["message"]) == without_ids(whole["message"])


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_auto_and_none_answer_content_when_no_call_is_written(client, tool_choice):
    reply = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 8, "tool_choice": tool_choice}).json()
    message = reply["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message


def test_auto_goes_unconstrained_where_no_backend_compiles_its_constraint(caplog):
    pytest.importorskip("llguidance")  # a backend without structural tags
    config = load_config(None, model=MODEL, device="cpu", dtype="float32", cache={"block_size": 8, "num_blocks": 128},
                         structured_outputs={"backend": "llguidance"}).config
    with TestClient(build_app(LLMEngine(config), ServeSettings(model_name=MODEL))) as client:
        response = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert "tool_choice auto goes unconstrained" in caplog.text and "llguidance" in caplog.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)


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
