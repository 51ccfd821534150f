"""Tool calls through the official `openai` client against a real `kvforge serve
kvforge-tiny`: the typed reply's calls, and the client's stream helper, which
accumulates the argument fragments into the same calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import openai_client, running_server  # noqa: E402
from test_serve_tool_calls import CALL_REGEX, TOOLS, calls_of  # noqa: E402

REQUEST = {"model": "kvforge-tiny", "messages": [{"role": "user", "content": "Time in Paris?"}], "tools": TOOLS,
           "max_tokens": 200, "temperature": 0, "frequency_penalty": 2.0}


@pytest.fixture(scope="module")
def client():
    with running_server() as server:
        yield openai_client(server)



@pytest.mark.parametrize("tool_choice, extra_body", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_weather"}}, None),
    ("auto", {"structured_outputs": {"regex": CALL_REGEX}}),
])
def test_the_stream_helper_accumulates_the_calls_of_the_reply(client, tool_choice, extra_body):
    reply = client.chat.completions.create(**REQUEST, tool_choice=tool_choice, extra_body=extra_body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message)
    with client.chat.completions.stream(**REQUEST, tool_choice=tool_choice, extra_body=extra_body) as stream:
        fragments = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(fragments) > 1 and final.finish_reason == "tool_calls"
    assert calls_of(final.message) == calls_of(choice.message)
    assert (final.message.content or None) == choice.message.content  # the stream opens with content ""


def test_a_conversation_goes_on_after_the_call_with_its_result(client):
    reply = client.chat.completions.create(**REQUEST, tool_choice="required", parallel_tool_calls=False)
    call = reply.choices[0].message.tool_calls[0]
    messages = [*REQUEST["messages"], reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    follow_up = client.chat.completions.create(**{**REQUEST, "messages": messages, "max_tokens": 4}, tool_choice="none")
    assert isinstance(follow_up.choices[0].message.content, str) and not follow_up.choices[0].message.tool_calls
