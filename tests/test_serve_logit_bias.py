"""`logit_bias` through the official `openai` client against a real `kvforge serve
kvforge-tiny`: under tool_choice "auto" the model chooses between a plain answer
and a `<tool_call>`, and a bias on `<` at the first position makes it choose the
call (whole and streamed); without the bias it answers in text. Bad keys and
values are 400s that name the key.

kvforge-tiny spells `<tool_call>` one byte at a time and never of its own accord,
and a static bias cannot make it spell all eleven bytes (one that favours `<`
favours it at every position), so the request's grammar offers the two outputs a
tool-calling model chooses between, a short answer or a whole call, and the model's
first token decides which."""

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
from test_serve_tool_calls import TOOLS, calls_of  # noqa: E402

ANSWER_OR_CALL = (r'[A-Za-z ][A-Za-z ,.]{0,30}'
                  r'|<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "days": [1-7]\}\}'
                  r'\n</tool_call>'
                  r'|<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>')
REQUEST = {"model": "kvforge-tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
           "tool_choice": "auto", "max_tokens": 120, "temperature": 0,
           "extra_body": {"structured_outputs": {"regex": ANSWER_OR_CALL}}}
CALL_FIRST = {str(ord("<")): 100}  # the first byte of `<tool_call>`


@pytest.fixture(scope="module")
def client():
    with running_server() as server:
        yield openai_client(server)



def test_without_a_bias_the_model_answers_in_text(client):
    choice = client.chat.completions.create(**REQUEST).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content and not choice.message.content.startswith("<")


def test_a_bias_on_the_first_byte_of_the_call_makes_the_model_call_a_tool(client):
    choice = client.chat.completions.create(**REQUEST, logit_bias=CALL_FIRST).choices[0]
    assert choice.finish_reason == "tool_calls" and len(calls_of(choice.message)) == 1
    assert not choice.message.content  # the call is all the output
    with client.chat.completions.stream(**REQUEST, logit_bias=CALL_FIRST) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and calls_of(final.message) == calls_of(choice.message)


@pytest.mark.parametrize("bias, named", [
    ({"x": 1}, "logit_bias"),
    ({"60": 101}, "logit_bias"),
    ({"259": 1}, "logit_bias keys ['259'] are outside the vocabulary [0, 259)"),
])
def test_a_bad_key_or_value_is_a_400_naming_it(client, bias, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**REQUEST, logit_bias=bias)
    assert named in caught.value.message and caught.value.body["param"].startswith("logit_bias")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="kvforge-tiny", prompt="def", max_tokens=2, logit_bias=bias)
    assert named in caught.value.message
