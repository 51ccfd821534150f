"""`kvforge serve`: an OpenAI-compatible HTTP server over the reference engine.

Every engine setting works as in `kvforge generate` (`--config FILE`,
`--set section.key=value`). See docs/serving.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .cli_options import add_config_options

log = logging.getLogger("kvforge.serve")


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a local Hugging Face directory or a built-in name (default: the config's model)")
    add_config_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("KVFORGE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVFORGE_API_KEY; "
                             "none: open)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model id clients send and /v1/models lists (default: MODEL as given)")
    parser.add_argument("--max-waiting-requests", type=int, metavar="N",
                        help="answer 503 with Retry-After once N requests wait to be scheduled (default: no bound)")
    parser.add_argument("--grace-period", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long running requests may finish before they are aborted (default: 30)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level (default: info)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        print(f"error: --max-waiting-requests must be >= 0, got {args.max_waiting_requests}", file=sys.stderr)
        return 2
    try:
        from kvforge.serving import ServeSettings, serve
    except ImportError as exc:
        print(f"error: kvforge serve needs the serve extra ({exc.name} is missing): "
              "pip install 'kvforge[serve]'", file=sys.stderr)
        return 2
    from kvforge.engine.llm import LLM

    from .cli_generate import selection_line

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sections = {"model": args.model} if args.model else {}
    engine = LLM(config_file=args.config, overrides=args.overrides, **sections).engine
    name = args.served_model_name or args.model or str(engine.config.model)
    print(selection_line(engine, verbose=True), file=sys.stderr)
    settings = ServeSettings(model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests)
    serve(engine, settings, host=args.host, port=args.port, grace_s=args.grace_period,
          log_level=args.uvicorn_log_level)
    return 0
