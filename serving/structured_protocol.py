"""Structured outputs in the request body, as OpenAI and vLLM accept them:
`response_format` ({"type": "json_schema", "json_schema": {"name": ..., "schema":
{...}}} or {"type": "json_object"}) and vLLM's `structured_outputs` object (sent by
the OpenAI client as `extra_body`) with one of `json`, `regex`, `choice`,
`grammar`, `json_object`. Both become the engine's `StructuredOutputsParams`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvforge.core import RequestError
from kvforge.engine.structured_outputs_params import StructuredOutputsParams

_CONFIG = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

STRUCTURED_OUTPUTS = "structured_outputs"  # the field, and a word every refusal of a spec names
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"  # the 400's code for a spec the server cannot follow


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema`."""

    model_config = _CONFIG

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = _CONFIG

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    grammar_syntax: Literal["ebnf", "lark"] | None = None
    any_whitespace: bool | None = None
    close_within_max_tokens: bool | None = None  # kvforge's: close the output within max_tokens


def structured_params(response_format: ResponseFormat | None,
                      structured_outputs: StructuredOutputsBody | None) -> StructuredOutputsParams | None:
    """The engine's constraint for a request body; `RequestError` (a 400) naming what is wrong."""
    if response_format is not None and response_format.type == "text":
        response_format = None
    if response_format is not None and structured_outputs is not None:
        raise RequestError("give response_format or structured_outputs, not both")
    if response_format is not None:
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=response_format.json_schema.schema_)
    if structured_outputs is None:
        return None
    fields = structured_outputs.model_dump(by_alias=True, exclude_none=True)
    return StructuredOutputsParams.from_dict(fields)
