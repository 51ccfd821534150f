"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal names what was wrong and, where there is one, the request field
(`param`), so a client can tell which of its inputs to fix.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal's body, as OpenAI sends it (documented in /openapi.json)."""

    error: ErrorDetail


class APIError(Exception):
    """A request the server refuses (or fails), with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def http_error_handler(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method) in the same shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if exc.status_code == 404:
        message += "; the routes are /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics"
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's findings as one 400 that names the first bad field (OpenAI
    and vLLM return 400, not FastAPI's default 422)."""
    problems, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "")
            return bad_request(f"the request body is not valid JSON ({detail}); send a JSON object",
                               code="invalid_json").response()
        loc = error.get("loc", ())
        # a rule across fields is raised on the body; its ctx names the field to fix
        field = _field_name(loc) or (error.get("ctx") or {}).get("param")
        union = _union_field(loc)
        if union is not None:  # one line for the field, not one per form it might have taken
            param = param or union
            line = f"{union}: {UNION_FORMS.get(union, 'matches none of the accepted forms (see /openapi.json)')}"
            if line not in problems:
                problems.append(line)
            continue
        if field is None and error.get("type") == "missing":
            return bad_request("the request body is missing; send a JSON object (Content-Type: application/json) "
                               "with the fields in docs/serving.md", code="missing_body").response()
        param = param or field
        message = error.get("msg", "invalid value")
        if error.get("type") == "extra_forbidden":
            message = "unknown field; see docs/serving.md for the fields this server accepts"
        elif error.get("type") == "missing":
            message = "this field is required"
        problems.append(f"{field or 'body'}: {message}")
    return bad_request("invalid request: " + "; ".join(problems), param=param).response()


UNION_FORMS = {"prompt": "give a non-empty string, a non-empty list of non-empty strings, a non-empty list of token "
                         "ids (integers from 0 to the vocabulary size less one), or a non-empty list of such lists"}
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict")


def _union_field(loc) -> str | None:
    """The field whose union pydantic tried (the location up to the first member's
    tag, such as `str` or `list[constrained-int]`), or None outside unions."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS):
            return _field_name(loc[:i]) or "body"
    return None


def _field_name(loc) -> str | None:
    """`messages.0.role` from pydantic's location, without "body" and the tags it
    gives the members of a union (`str`, `list[constrained-int]`, ...)."""
    loc = loc[1:] if loc[:1] == ("body",) else loc
    parts = [str(part) for part in loc if isinstance(part, int) or part.isidentifier() and part not in _TYPE_TAGS]
    return ".".join(parts) or None
