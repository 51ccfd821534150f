"""The FastAPI application: routes, the API-key check, error handlers, and the
engine loop started and stopped with the app's lifespan. The LoRA routes are in
lora_routes.py."""

from __future__ import annotations

import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kvforge.engine.llm_engine import LLMEngine

from .errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from .openai_api import OpenAIServer, ServeSettings
from .lora_routes import install_lora_routes
from .openapi_schema import HEALTH_RESPONSES, METRICS_RESPONSES, error_responses, generation_responses, install
from .protocol import ChatCompletionRequest, CompletionRequest
from .replica_pool import ReplicaPool


class ApiKeyMiddleware:
    """With an API key set, every `/v1/...` request must carry
    `Authorization: Bearer KEY`; the comparison takes the same time whatever the
    given key, so timing does not reveal how much of it was right. `/health` and
    `/metrics` stay open, as in vLLM."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = ("missing API key; send 'Authorization: Bearer KEY'" if not given
                           else "incorrect API key; send the key the server was started with (--api-key)")
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine | None, settings: ServeSettings, *, replicas: ReplicaPool | None = None) -> FastAPI:
    """An app serving `engine` (or the data-parallel `replicas`) under
    `settings.model_name`. The engine loop runs while the app is up (its lifespan)."""
    server = OpenAIServer(engine, settings, replicas=replicas)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            await server.loop.stop()

    app = FastAPI(title="kvforge", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    keyed = bool(settings.api_key)
    if keyed:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    install(app, server.model, api_key=keyed)
    generation = generation_responses(keyed)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        status, body = server.loop.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(401) if keyed else None)
    async def models() -> JSONResponse:
        """The served model, then each LoRA adapter (its `parent` the served model), as vLLM lists them."""
        base = {"id": settings.model_name, "object": "model", "created": started, "owned_by": "kvforge",
                "root": server.model.root, "parent": None, "max_model_len": server.model.max_model_len}
        return JSONResponse({"object": "list", "data": [base, *server.adapters.model_cards(started)]})

    install_lora_routes(app, server.adapters, enabled=settings.enable_lora_updates, keyed=keyed)

    @app.post("/v1/completions", responses=generation)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions", responses=generation)
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        return await server.chat(request, body)

    return app
