"""Options shared by every sub-command that builds a configuration."""

from __future__ import annotations

import argparse
import json

from kvforge.core import LoadedConfig, Registry, build_registry, load_config


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable), e.g. --set cache.block_size=32")


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size`, `--pipeline-parallel-size` and `--executor`: shorthands
    for the `parallel` settings, read back by `parallel_overrides`."""
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N",
                        help="split the model over N ranks (parallel.tensor_parallel_size; N - 1 workers)")
    parser.add_argument("--pipeline-parallel-size", type=int, metavar="N",
                        help="split the model's layers into N stages (parallel.pipeline_parallel_size)")
    parser.add_argument("--executor", metavar="NAME",
                        help="what runs the workers (parallel.executor): mp (processes on this host), ray (Ray "
                             "actors), torchrun (the processes torchrun started); default auto")


def parallel_overrides(args: argparse.Namespace) -> list[str]:
    """`args.overrides` (`--set`) followed by the parallel shorthands that were given."""
    overrides = list(args.overrides)
    if args.tensor_parallel_size is not None:
        overrides.append(f"parallel.tensor_parallel_size={args.tensor_parallel_size}")
    if args.pipeline_parallel_size is not None:
        overrides.append(f"parallel.pipeline_parallel_size={args.pipeline_parallel_size}")
    if args.executor is not None:
        overrides.append(f"parallel.executor={json.dumps(args.executor)}")
    return overrides


def config_from_args(args: argparse.Namespace) -> LoadedConfig:
    return load_config(config_file=args.config, overrides=args.overrides)


def registry_from_config(loaded: LoadedConfig, log_errors: bool = True) -> Registry:
    """The registry the configuration's `plugins` section asks for; `log_errors=False`
    for a command that shows the load errors itself."""
    plugins = loaded.config.plugins
    return build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict, log_errors=log_errors)
