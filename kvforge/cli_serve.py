"""`kvforge serve`: an OpenAI-compatible HTTP server over the reference engine.

Every engine setting works as in `kvforge generate` (`--config FILE`,
`--set section.key=value`). See docs/serving.md, and docs/lora.md for the LoRA
flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .cli_options import (add_batch_invariant_option, add_config_options, add_lora_options, add_parallel_options,
                          batch_invariant_overrides, lora_modules, lora_overrides, parallel_overrides)

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
    parser.add_argument("--threads", type=int,
                        help="CPU threads for torch (default: torch's choice); with replicas, of each replica")
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="serve with N engine replicas, each in its own process, behind this one server; "
                             "each request goes to one replica (default: 1, one engine in the server's process)")
    parser.add_argument("--data-parallel-routing", choices=("least_tokens", "prefix"), default="least_tokens",
                        help="with replicas: least_tokens sends each request to the replica with the fewest "
                             "outstanding tokens; prefix sends prompts opening with the same block of tokens to "
                             "the same replica (its prefix cache hits) unless it is much busier (default: "
                             "least_tokens)")
    add_parallel_options(parser)
    add_batch_invariant_option(parser)
    add_lora_options(parser)
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level (default: info)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        print(f"error: --max-waiting-requests must be >= 0, got {args.max_waiting_requests}", file=sys.stderr)
        return 2
    if args.data_parallel_size < 1:
        print(f"error: --data-parallel-size must be >= 1, got {args.data_parallel_size}", file=sys.stderr)
        return 2
    try:
        modules = lora_modules(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        from kvforge.serving import ServeSettings, serve
    except ImportError as exc:
        print(f"error: kvforge serve needs the serve extra ({exc.name} is missing): "
              "pip install 'kvforge[serve]'", file=sys.stderr)
        return 2
    from kvforge.engine.llm import LLM
    from kvforge.engine.long_lived import long_lived_start_up

    from .cli_generate import selection_line

    args.overrides = parallel_overrides(args) + lora_overrides(args) + batch_invariant_overrides(args)
    if args.data_parallel_size > 1:
        return _run_replicas(args, ServeSettings, serve, selection_line)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sections = {"model": args.model} if args.model else {}
    with long_lived_start_up():  # one engine, serving until the process exits
        engine = LLM(config_file=args.config, overrides=args.overrides, **sections).engine
    name = args.served_model_name or args.model or str(engine.config.model)
    print(selection_line(engine, verbose=True), file=sys.stderr)
    try:
        adapters = _load_adapters(engine, modules, name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = ServeSettings(model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                             lora_modules=adapters, enable_lora_updates=args.enable_lora_updates)
    serve(engine, settings, host=args.host, port=args.port, grace_s=args.grace_period,
          log_level=args.uvicorn_log_level)
    return 0


def _load_adapters(engine, modules, served_name: str) -> list:
    """`--lora-modules` loaded by the engine before the server starts (numbered 1, 2, ...
    in the order given), so a bad adapter stops the start with its reason; `ValueError`."""
    from kvforge.core import ConfigError, RequestError
    from kvforge.engine.lora_request import LoRARequest

    requests = []
    for number, module in enumerate(modules, start=1):
        if module.base_model_name is not None and module.base_model_name != served_name:
            raise ValueError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} is not the "
                             f"served model {served_name!r}; this server serves one base model (leave "
                             "base_model_name out, or give it --served-model-name)")
        request = LoRARequest(module.name, number, module.path)
        try:
            engine.add_lora(request)
        except (ConfigError, RequestError) as exc:  # LoRAAdapterError is a ConfigError
            raise ValueError(f"--lora-modules {module.name!r}: {exc}") from None
        requests.append(request)
    if requests:
        log.info("serving LoRA adapters %s", ", ".join(r.lora_name for r in requests))
    return requests


def _run_replicas(args: argparse.Namespace, ServeSettings, serve, selection_line) -> int:
    """`--data-parallel-size N`: N replica processes build their engines; this
    process keeps the HTTP front end and routes to them."""
    from functools import partial

    from kvforge.core import load_config
    from kvforge.serving.replica_pool import ReplicaPool, ReplicaStartError
    from kvforge.serving.replica_process import ReplicaSpec

    # A bad setting is refused here, once, before N processes each load the model to find it.
    loaded = load_config(args.config, overrides=args.overrides, **({"model": args.model} if args.model else {}))
    if loaded.config.lora.enabled:
        print(f"error: --data-parallel-size {args.data_parallel_size} with LoRA adapters is not supported yet: "
              "adapters are served by one engine; drop --data-parallel-size, or serve without LoRA (no "
              "--lora-modules, --enable-lora or lora settings)", file=sys.stderr)
        return 2
    if loaded.config.parallel.world_size > 1:
        print(f"error: --data-parallel-size {args.data_parallel_size} with parallel.world_size "
              f"{loaded.config.parallel.world_size} (tensor x pipeline parallel) is not supported yet: replicas of "
              "a multi-rank engine are not built; use one of the two", file=sys.stderr)
        return 2
    spec = ReplicaSpec(config_file=args.config, overrides=list(args.overrides or []), model=args.model,
                       threads=args.threads, describe=partial(selection_line, verbose=True))
    try:
        pool = ReplicaPool.start(spec, args.data_parallel_size)
    except ReplicaStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    first = pool.replicas[0].info
    print(f"{first.selection}; data parallel over {args.data_parallel_size} replicas (pids "
          f"{', '.join(str(r.pid) for r in pool.replicas)}), routing {args.data_parallel_routing}", file=sys.stderr)
    name = args.served_model_name or args.model or first.model.root
    settings = ServeSettings(model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                             data_parallel_routing=args.data_parallel_routing)
    serve(None, settings, host=args.host, port=args.port, grace_s=args.grace_period,
          log_level=args.uvicorn_log_level, replicas=pool)
    return 0
