"""Run the app under uvicorn, with a graceful shutdown: on SIGTERM (or Ctrl-C)
the server stops accepting connections, lets running requests finish for up to
`grace_s` seconds, then aborts what is left (its KV blocks are freed) and exits."""

from __future__ import annotations

import uvicorn

from kvforge.engine.llm_engine import LLMEngine

from .app import build_app
from .openai_api import ServeSettings


def serve(engine: LLMEngine, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000,
          grace_s: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGTERM or SIGINT."""
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s,
                            lifespan="on")
    uvicorn.Server(config).run()
