"""Run the app under uvicorn, with a graceful shutdown: on SIGTERM (or Ctrl-C)
the server stops accepting connections, lets running requests finish for up to
`grace_s` seconds, then aborts what is left (its KV blocks are freed) and exits."""

from __future__ import annotations

import logging
import signal

import uvicorn

from kvforge.engine.llm_engine import LLMEngine

from .app import build_app
from .openai_api import ServeSettings
from .replica_pool import ReplicaPool


def serve(engine: LLMEngine | None, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000,
          grace_s: float = 30.0, log_level: str = "info", replicas: ReplicaPool | None = None) -> None:
    """Serve `engine`, or the data-parallel `replicas`, until SIGTERM or SIGINT;
    the replicas are stopped however serving ends."""
    app = build_app(engine, settings, replicas=replicas)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s,
                            lifespan="on")
    # uvicorn re-raises the signal it shut down on once it is done; a SIGTERM that
    # ended in a graceful shutdown is a normal exit (status 0), not a kill.
    previous = signal.signal(signal.SIGTERM, _stopped_by_sigterm)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if replicas is not None:  # normally stopped with the app; here also when uvicorn never started
            replicas.stop()


def _stopped_by_sigterm(signum, frame) -> None:
    logging.getLogger(__name__).info("stopped by SIGTERM after a graceful shutdown")
