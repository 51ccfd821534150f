"""Tool calling on chat completions, as OpenAI's API has it: `tools` (functions
with JSON-schema `parameters`), `tool_choice` and `parallel_tool_calls`.

`tool_choice` = a named function constrains the output to that function's
arguments (a JSON document its `parameters` validate); `"required"` constrains
it to a JSON array of calls `[{"name": ..., "parameters": {...}}]` (one call
unless `parallel_tool_calls`), each call's parameters validated by its own
function's schema, as vLLM does. `"auto"` (the default with tools) allows free
text or Hermes-style `<tool_call>` blocks (see `tool_call_format`) whose
arguments validate: xgrammar's structural tag, triggered by `<tool_call>`.
`"none"` leaves the output free and answers it as content. The answer carries
`tool_calls` (finish reason "tool_calls") when the output holds calls."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from kvforge.core import RequestError
from kvforge.engine.structured_outputs_params import StructuredOutputsParams, check_schema

from .request_config import REQUEST_CONFIG
from .tool_call_format import (
    AUTO,
    HERMES_CALL_HEAD,
    HERMES_CALL_TAIL,
    NAMED,
    REQUIRED,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Scan,
    ToolCallReader,
)

INVALID_TOOL_CHOICE = "invalid_tool_choice"  # the 400's code when tool_choice and tools disagree


class FunctionDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class ToolDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = REQUEST_CONFIG

    name: str


class NamedToolChoice(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = REQUEST_CONFIG

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back in the conversation."""

    model_config = REQUEST_CONFIG

    id: str
    type: Literal["function"]
    function: CalledFunction


def tool_constraint(tools: list[ToolDefinition] | None, tool_choice, parallel: bool) -> StructuredOutputsParams | None:
    """The output constraint `tool_choice` asks for; `RequestError` (code `invalid_tool_choice`)
    when it names a function `tools` lacks, or forces a call without tools."""
    if tool_choice == "none" or (tool_choice in (None, "auto") and not tools):
        return None
    functions = {tool.function.name: tool.function for tool in tools or []}
    if not functions:
        raise RequestError(f"tool_choice {_describe(tool_choice)} needs tools; give tools or drop tool_choice")
    if tool_choice in (None, "auto"):
        return StructuredOutputsParams(structural_tag=json.dumps(auto_calls_tag(list(functions.values()), parallel)))
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in functions:
            raise RequestError(f"tool_choice names function {name!r}, which is not among tools "
                               f"({', '.join(functions)}); name one of them")
        return StructuredOutputsParams(json=functions[name].schema)
    return StructuredOutputsParams(json=calls_schema(list(functions.values()), parallel))


def auto_calls_tag(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """xgrammar's structural tag for "auto": any text; from each `<tool_call>` on, a
    whole Hermes-style call to one of `functions` with arguments its schema validates
    (after the first call only the end of the output, unless `parallel`). Whitespace in
    the arguments comes one character at a time, so a small model cannot spin on it."""
    for function in functions:
        try:
            check_schema(function.schema)
        except RequestError as exc:
            raise RequestError(f"tools: function {function.name!r} has parameters that are not a valid JSON "
                               f"schema ({exc}); fix its parameters") from None
    tags = [{"type": "tag", "begin": f"{TOOL_CALL_START}\n{HERMES_CALL_HEAD.format(name=json.dumps(f.name))}",
             "content": {"type": "json_schema", "json_schema": f.schema, "max_whitespace_cnt": 1},
             "end": f"{HERMES_CALL_TAIL}\n{TOOL_CALL_END}"} for f in functions]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [TOOL_CALL_START],
                                                 "tags": tags, "at_least_one": False,
                                                 "stop_after_first": not parallel}}


def tool_call_reader(tools: list[ToolDefinition] | None, tool_choice, parallel: bool,
                     constrained: bool) -> ToolCallReader | None:
    """How the output carries calls under `tool_choice`; None when it carries none."""
    if tool_choice == "none" or not tools:
        return None
    names = frozenset(tool.function.name for tool in tools)
    max_calls = None if parallel else 1
    if isinstance(tool_choice, NamedToolChoice):
        return ToolCallReader(NAMED, frozenset({tool_choice.function.name}), 1, constrained)
    return ToolCallReader(REQUIRED if tool_choice == "required" else AUTO, names, max_calls, constrained)


def chat_answer(text: str, finish_reason: str | None, reader: ToolCallReader | None) -> tuple[dict, str | None]:
    """The assistant message of a finished output and its finish reason: its content
    and the calls `reader` finds ("tool_calls" when there are calls and the output
    ended on its own)."""
    if reader is None:
        return {"role": "assistant", "content": text}, finish_reason
    message = chat_message(reader.scan(text, final=True))
    return message, "tool_calls" if "tool_calls" in message and finish_reason == "stop" else finish_reason


def chat_message(scan: Scan) -> dict:
    """The assistant message of a complete output's scan (content None when blank)."""
    content = scan.content if scan.content.strip() or not scan.calls else None
    if not scan.calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": call_id(), "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}} for c in scan.calls]}


def calls_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of `{"name", "parameters"}` calls, one per function's own schema."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.schema},
                       "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _describe(tool_choice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else f"function {tool_choice.function.name!r}"
