"""Tool calling on chat completions, as OpenAI's API has it: `tools` (functions
with JSON-schema `parameters`), `tool_choice` and `parallel_tool_calls`.

`tool_choice` = a named function constrains the output to that function's
arguments (a JSON document its `parameters` validate); `"required"` constrains
it to a JSON array of calls `[{"name": ..., "parameters": {...}}]` (one call
unless `parallel_tool_calls`), each call's parameters validated by its own
function's schema, as vLLM does; the answer carries `tool_calls` (finish reason
"tool_calls"). `"auto"` and `"none"` leave the output free and answer it as
content: kvforge's models have no tool-call format of their own to parse."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvforge.core import RequestError
from kvforge.engine.structured_outputs_params import StructuredOutputsParams

_CONFIG = ConfigDict(extra="forbid", strict=True)
INVALID_TOOL_CHOICE = "invalid_tool_choice"  # the 400's code when tool_choice and tools disagree


class FunctionDefinition(BaseModel):
    model_config = _CONFIG

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class ToolDefinition(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _CONFIG

    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _CONFIG

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back in the conversation."""

    model_config = _CONFIG

    id: str
    type: Literal["function"]
    function: CalledFunction


def tool_constraint(tools: list[ToolDefinition] | None, tool_choice, parallel: bool) -> StructuredOutputsParams | None:
    """The output constraint `tool_choice` asks for; `RequestError` (code `invalid_tool_choice`)
    when it names a function `tools` lacks, or forces a call without tools."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = {tool.function.name: tool.function for tool in tools or []}
    if not functions:
        raise RequestError(f"tool_choice {_describe(tool_choice)} needs tools; give tools or drop tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in functions:
            raise RequestError(f"tool_choice names function {name!r}, which is not among tools "
                               f"({', '.join(functions)}); name one of them")
        return StructuredOutputsParams(json=functions[name].schema)
    return StructuredOutputsParams(json=calls_schema(list(functions.values()), parallel))


def calls_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of `{"name", "parameters"}` calls, one per function's own schema."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.schema},
                       "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_calls_of(text: str, tool_choice) -> list[dict] | None:
    """The OpenAI `tool_calls` of a complete output under a forced `tool_choice`;
    None when it is content (free output, or one cut short before it parsed)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return [_call(tool_choice.function.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters", {}))) for c in calls]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _describe(tool_choice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else f"function {tool_choice.function.name!r}"
