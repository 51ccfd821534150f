"""Reading tool calls out of text (no model): Hermes-style blocks under "auto",
the JSON array under "required", the arguments under a named function; and the
stream's deltas, which must add up to what the complete text gives."""

from __future__ import annotations

import json

import pytest

from kvforge.serving.tool_call_format import AUTO, NAMED, REQUIRED, ToolCallReader, hermes_call_text, value_end
from kvforge.serving.tool_call_stream import ToolCallDeltas
from kvforge.serving.tool_calls import chat_message

NAMES = frozenset({"get_weather", "get_time"})
AUTO_READER = ToolCallReader(AUTO, NAMES)
WEATHER = hermes_call_text("get_weather", '{"city": "Paris", "days": 3}')
TIME = hermes_call_text("get_time", '{"zone": "UTC"}')


def calls(scan):
    return [(c.name, json.loads(c.arguments)) for c in scan.calls]


def test_one_call_is_read_with_its_arguments_as_written():
    scan = AUTO_READER.scan(WEATHER, final=True)
    assert calls(scan) == [("get_weather", {"city": "Paris", "days": 3})] and scan.content == ""
    assert scan.calls[0].arguments == '{"city": "Paris", "days": 3}'


def test_two_calls_and_the_text_around_them():
    scan = AUTO_READER.scan(f"Let me check. {WEATHER}\n{TIME} Done.", final=True)
    assert calls(scan) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
    assert scan.content == "Let me check. \n Done."


def test_text_without_a_call_is_all_content():
    scan = AUTO_READER.scan("Paris is sunny; a < b and <tool is not a call.", final=True)
    assert scan.calls == [] and scan.content == "Paris is sunny; a < b and <tool is not a call."


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "get_mood", "arguments": {}}\n</tool_call>',  # a function the request lacks
    '<tool_call>\n{"arguments": {"zone": "UTC"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_time", "arguments": "UTC"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}',  # never closed
])
def test_a_block_that_is_not_a_well_formed_call_stays_content(block):
    scan = AUTO_READER.scan(f"before {block} after {TIME}", final=True)
    assert calls(scan) == ([("get_time", {"zone": "UTC"})] if "</tool_call>" in block else [])
    assert scan.content.startswith(f"before {block} after")


def test_a_call_written_another_way_is_read_and_its_arguments_reserialized():
    scan = AUTO_READER.scan('<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', final=True)
    assert calls(scan) == [("get_time", {"zone": "CET"})]


def test_without_parallel_calls_only_the_first_call_is_one():
    scan = ToolCallReader(AUTO, NAMES, max_calls=1).scan(f"{WEATHER}{TIME}", final=True)
    assert [c.name for c in scan.calls] == ["get_weather"] and scan.content == TIME


def test_required_reads_the_array_and_refuses_an_unknown_name_or_a_cut_array():
    reader = ToolCallReader(REQUIRED, NAMES)
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name":"get_weather","parameters":{"city":"x"}}]'
    assert calls(reader.scan(text, final=True)) == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "x"})]
    for bad in (text.replace("get_time", "get_mood"), text[:-1]):
        assert reader.scan(bad, final=True).calls == [] and reader.scan(bad, final=True).content == bad


def test_the_message_has_null_content_beside_calls_and_text_without_them():
    assert chat_message(AUTO_READER.scan(f" {TIME}", final=True))["content"] is None
    message = chat_message(AUTO_READER.scan("no call", final=True))
    assert message == {"role": "assistant", "content": "no call"}


@pytest.mark.parametrize("text, start, rest", [
    ('{"a": "}", "b": [1, {"c": "\\"}"}]} tail', 0, " tail"), ('  "x\\"y" ,', 2, " ,"), ("12, 3", 0, ", 3"),
    ("12", 0, None), ('{"a": [1, 2', 0, None),
])
def test_value_end_finds_where_a_json_value_closes(text, start, rest):
    """`rest`: the text after the value; None while the value is still open."""
    end = value_end(text, start)
    assert (None if end is None else text[end:]) == rest
    if rest is not None:
        json.loads(text[start:end])


def streamed(reader, text, step):
    """The deltas of `text` arriving `step` characters at a time, then finished."""
    stream = ToolCallDeltas(reader)
    prefixes = [text[:i] for i in range(step, len(text), step)] + [text]
    deltas = [stream.delta(prefix, final=prefix is text) for prefix in prefixes]
    return [d for d in deltas if d]


def added_up(deltas):
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("reader, text", [
    (AUTO_READER, f"Let me check. {WEATHER}\n{TIME} Done."),
    (ToolCallReader(AUTO, NAMES, constrained=False), f"a <tool_call>{{bad</tool_call> b {WEATHER} <tool_c"),
    (ToolCallReader(REQUIRED, NAMES), '[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                                      '{"name": "get_weather", "parameters": {"city": "[}\\"", "days": 2}}]'),
    (ToolCallReader(NAMED, frozenset({"get_time"})), '{"zone": "CET"}'),
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_complete_answer(reader, text, step):
    content, streamed_calls = added_up(streamed(reader, text, step))
    final = reader.scan(text, final=True)
    assert content == final.content
    assert streamed_calls == [{"name": c.name, "arguments": c.arguments} for c in final.calls] and final.calls


def test_constrained_arguments_stream_before_the_call_closes_and_unconstrained_ones_wait():
    text = WEATHER[:WEATHER.index('"days"')]
    constrained = ToolCallDeltas(AUTO_READER).delta("Hi " + text, final=False)
    assert constrained["content"] == "Hi " and constrained["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris", '}
    assert ToolCallDeltas(ToolCallReader(AUTO, NAMES, constrained=False)).delta("Hi " + text, final=False) == {
        "content": "Hi "}


def test_a_tail_that_may_begin_a_call_is_held_back_until_it_does_not():
    stream = ToolCallDeltas(AUTO_READER)
    assert stream.delta("Hello <tool", final=False) == {"content": "Hello "}
    assert stream.delta("Hello <tooth", final=False) == {"content": "<tooth"}


def test_a_call_sent_back_in_the_conversation_reads_as_the_same_call():
    from kvforge.serving.protocol import ChatMessage

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    message = ChatMessage.model_validate({"role": "assistant", "content": "Checking. ", "tool_calls": [call, call]})
    scan = AUTO_READER.scan(message.text(), final=True)
    assert scan.content == "Checking. " and [(c.name, c.arguments) for c in scan.calls] == [
        ("get_time", '{"zone": "UTC"}')] * 2
