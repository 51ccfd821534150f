"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, vLLM's routes
for changing the served LoRA adapters at run time.

As vLLM keeps them behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, kvforge keeps them
behind `--enable-lora-updates`: anyone who can reach the server can then make it
read a directory of its file system. Without the flag both answer 404 with a
message naming it, and /openapi.json does not list them. A success answers 200
with vLLM's line of plain text.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine_loop import EngineDeadError
from .errors import APIError, bad_request
from .openapi_schema import ERROR_DESCRIPTIONS
from .served_adapters import ServedAdapters

UPDATES_FLAG = "--enable-lora-updates"


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="the name requests give as `model`")
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory on the server's file system "
                                                     "(adapter_config.json, adapter_model.safetensors)")


class UnloadLoRAAdapterRequest(BaseModel):
    """`lora_name` or `lora_int_id` (or both, which must then name the same adapter)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "anyOf": [{"required": ["lora_name"]}, {"required": ["lora_int_id"]}]})

    lora_name: str = Field(None, min_length=1, description="the adapter's name")
    lora_int_id: int = Field(None, ge=1, description="or its number (given when it was loaded)")


LORA_ERRORS = {
    400: "The body is not as the schema says, or (`code: invalid_lora_adapter`) `lora_path` is not a PEFT adapter "
         "this model runs (the message names the file or field), or (`code: lora_adapter_exists`) `lora_name` is "
         "already served.",
    401: ERROR_DESCRIPTIONS[401],
    404: "No served adapter has that `lora_name` (or `lora_int_id`) (`code: lora_adapter_not_found`).",
    503: "The engine has stopped (`code: engine_dead`).",
}


def _responses(keyed: bool, *statuses: int) -> dict:
    ok = {200: {"description": "Done: vLLM's line of plain text.",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}
    errors = sorted({*statuses, *([401] if keyed else []), 503})
    # Given as content, not `model`: FastAPI files a model under the route's own type, text/plain.
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {**ok, **{status: {"description": LORA_ERRORS[status], "content": error} for status in errors}}


def install_lora_routes(app: FastAPI, adapters: ServedAdapters, *, enabled: bool, keyed: bool) -> None:
    """The two routes; without `enabled` (`--enable-lora-updates`) each answers 404
    saying how to turn them on, whatever the body, and the schema leaves them out."""
    if not enabled:
        async def refused() -> None:
            raise APIError(404, f"loading and unloading LoRA adapters at run time is off; start kvforge serve with "
                           f"{UPDATES_FLAG} (adapters to serve from the start: --lora-modules NAME=PATH)",
                           code="lora_updates_disabled")

        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            app.post(path, include_in_schema=False)(refused)
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_responses(keyed, 400))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await adapters.load(body.lora_name, body.lora_path)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_responses(keyed, 400, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name is None and body.lora_int_id is None:
            raise bad_request("give lora_name (or lora_int_id) of the adapter to unload", param="lora_name")
        try:
            request = await adapters.unload(body.lora_name, body.lora_int_id)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
