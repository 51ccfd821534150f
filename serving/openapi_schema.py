"""What /openapi.json says beyond the request models: every status each route
answers, with OpenAI's error body; the JSON of /health, the Prometheus text of
/metrics and the event stream of `stream: true`; the bearer key when the server
has one; and the served model's token ids (below its vocabulary size). How many
tokens fit the context depends on the prompt's tokenization, which JSON Schema
cannot state: that refusal is documented with its code instead.

Validation errors are 400 in OpenAI's shape, as OpenAI and vLLM answer them, so
FastAPI's default 422 is not documented: the server never sends it. The schema
is checked against a running server by schemathesis (tests/test_serve_openapi.py).
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel

from .errors import ErrorResponse
from .protocol import token_id_pattern
from .served_model import ServedModel

# A request the schema allows is still refused (400) when the prompt and
# max_tokens do not fit the context, or min_tokens exceeds max_tokens: rules
# between a prompt's tokenization and other fields that JSON Schema cannot state;
# or when its structured-outputs spec is not one the server can follow (an invalid
# schema, regex or grammar, more than one constraint, one the backend cannot compile),
# or its tool_choice forces a call to a function tools lack.
# No other schema-valid request is refused with 400.
CODES_BEYOND_THE_SCHEMA = ("context_length_exceeded", "min_tokens_exceed_max_tokens", "invalid_structured_output",
                           "invalid_tool_choice")

ERROR_DESCRIPTIONS = {
    400: "Invalid request: the body is missing or not JSON, a field has the wrong type or is out of range, or a "
         "field is unknown (`param` names it). Also, for rules the schema cannot state: the prompt and max_tokens "
         "do not fit the model's context (`code: context_length_exceeded`), or min_tokens exceeds max_tokens "
         "(`code: min_tokens_exceed_max_tokens`), or the `response_format` / `structured_outputs` spec cannot be "
         "followed: an invalid JSON schema, regex or grammar, more than one constraint, or one the server's "
         "backend cannot compile (`code: invalid_structured_output`), or tool_choice forces a call without tools "
         "or to a function they lack (`code: invalid_tool_choice`).",
    401: "The server requires an API key (`--api-key`) and `Authorization: Bearer KEY` is missing or wrong "
         "(`code: invalid_api_key`).",
    404: "`model` is neither the served model nor one of its LoRA adapters (`code: model_not_found`); GET "
         "/v1/models lists them.",
    500: "The engine ended the request with an error (`code: generation_failed` or `engine_dead`). In a stream the "
         "error arrives as a `data: {\"error\": ...}` event before `[DONE]` instead.",
    503: "The server is busy (`--max-waiting-requests` reached; `code: server_busy`, with a `Retry-After` header) "
         "or its engine has stopped (`code: engine_dead`).",
}


class ReplicaHealth(BaseModel):
    index: int
    pid: int | None
    alive: bool
    error: str | None = None


class Health(BaseModel):
    """`GET /health`: `ok` (200), `degraded` (200, some data-parallel replicas
    dead), `dead` or `stopping` (503). `replicas` only with data-parallel replicas."""

    status: Literal["ok", "degraded", "dead", "stopping"]
    error: str | None = None
    replicas: list[ReplicaHealth] | None = None


def error_responses(*statuses: int) -> dict:
    """FastAPI's `responses=` for these error statuses, each with the error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


# One server-sent event (OpenAPI 3.1 describes a stream by its events).
STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk (or, when the request failed mid-stream, an error body); "
                                     "the last event's data is `[DONE]`"}}}


def generation_responses(api_key: bool) -> dict:
    """What `/v1/completions` and `/v1/chat/completions` answer."""
    stream = {"description": "The response; with `stream: true` server-sent events ending with `data: [DONE]`.",
              "content": {"text/event-stream": {"schema": STREAM_EVENT}}}
    return {200: stream, **error_responses(400, *([401] if api_key else []), 404, 500, 503)}


HEALTH_RESPONSES = {200: {"model": Health, "description": "The engine serves (`ok`, or `degraded`)."},
                    503: {"model": Health, "description": "The engine has failed or is stopping."}}
METRICS_RESPONSES = {200: {"description": "Prometheus text exposition under vLLM's metric names.",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}}


def install(app: FastAPI, model: ServedModel, *, api_key: bool) -> None:
    """Make `app.openapi()` describe what this server does (see the module's docstring)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            _describe(build(), model, api_key)
        return app.openapi_schema

    app.openapi = openapi


def _describe(schema: dict, model: ServedModel, api_key: bool) -> None:
    components = schema.setdefault("components", {})
    for operations in schema["paths"].values():
        for path_operation in operations.values():
            path_operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    models = components.get("schemas", {})
    if "CompletionRequest" in models:
        _bound_integers(models["CompletionRequest"]["properties"]["prompt"],
                        {"maximum": model.vocab_size - 1, "description": "a token id of the served model"})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        if name in models:  # logit_bias keys: the served model's token ids
            bias = next(form for form in models[name]["properties"]["logit_bias"]["anyOf"] if form["type"] == "object")
            bias["propertyNames"] = {"pattern": token_id_pattern(model.vocab_size)}
    if api_key:
        components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path.startswith("/v1"):
                for path_operation in operations.values():
                    path_operation["security"] = [{"apiKey": []}]


def _bound_integers(node, bound: dict) -> None:
    """Add `bound` to every integer schema in `node`."""
    if isinstance(node, list):
        for item in node:
            _bound_integers(item, bound)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(bound)
        for value in node.values():
            _bound_integers(value, bound)
