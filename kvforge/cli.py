"""`kvforge` command line: one sub-command per job, each in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from kvforge.core import KvforgeError

from . import cli_bench, cli_config, cli_conformance, cli_eval, cli_generate, cli_kernels, cli_plugins, cli_serve

COMMANDS = (cli_plugins, cli_config, cli_conformance, cli_generate, cli_serve, cli_bench, cli_eval, cli_kernels)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="kvforge: plugin-based LLM inference kernels and backends")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except KvforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
