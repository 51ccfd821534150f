"""schemathesis hooks and checks for tests/test_serve_openapi.py, loaded by the
`schemathesis run` it starts (SCHEMATHESIS_HOOKS=openapi_hooks).

- `schema_valid_request_accepted` is schemathesis's `positive_data_acceptance`
  with the one exception /openapi.json documents: a 400 whose `code` is one of
  `CODES_BEYOND_THE_SCHEMA` (the prompt and max_tokens must fit the context; rules
  JSON Schema cannot state). Any other refusal of a request that the schema's
  validator accepts fails (a body generated as valid that is not, is not one).
- `cheap_generation` keeps each valid request's work small (n <= 2, at most 4
  new tokens) by lowering values of requests generated as valid; they stay
  valid, so every check still applies, and fuzzing costs seconds, not the
  minutes that `n: 128` over the whole context would.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.core.jsonschema import make_validator
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvforge.serving.openapi_schema import CODES_BEYOND_THE_SCHEMA

MAX_N = 2
MAX_NEW_TOKENS = 4


@schemathesis.check
def schema_valid_request_accepted(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and _error_code(response) in CODES_BEYOND_THE_SCHEMA:
            return None
        if not _body_is_schema_valid(case):  # generated as valid, but it is not: refusing it is right
            return None
        raise


def _body_is_schema_valid(case) -> bool:
    body = case.operation.get_body_for_media_type(case.media_type) if case.media_type else None
    if body is None or not isinstance(case.body, dict):
        return True
    validator_cls = case.operation.schema.adapter.jsonschema_validator_cls
    return make_validator(body.validation_schema, validator_cls).is_valid(case.body)


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if not positive or not isinstance(body, dict) or not case.operation.path.startswith("/v1/"):
        return  # an invalid request is refused before it generates anything
    if _number(body.get("n")) and body["n"] > MAX_N:
        body["n"] = MAX_N
    for field in ("max_tokens", "max_completion_tokens"):
        if _number(body.get(field)) and body[field] > MAX_NEW_TOKENS:
            body[field] = MAX_NEW_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS  # null: the whole context
    if _number(body.get("min_tokens")) and body["min_tokens"] > MAX_NEW_TOKENS:
        body["min_tokens"] = MAX_NEW_TOKENS
