"""kvforge's OpenAI-compatible HTTP server (`kvforge serve`): FastAPI and uvicorn
over one engine loop (or, with `--data-parallel-size N`, over N engine replicas
in processes of their own), with Prometheus metrics under vLLM's names. Needs the
`serve` extra: `pip install 'kvforge[serve]'`."""

from .app import build_app
from .engine_loop import EngineDeadError, EngineLoop
from .openai_api import OpenAIServer, ServeSettings
from .server import serve

__all__ = ["EngineDeadError", "EngineLoop", "OpenAIServer", "ServeSettings", "build_app", "serve"]
