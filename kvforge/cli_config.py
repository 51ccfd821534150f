"""`kvforge config show`: the effective configuration and where each value came from."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvforge.core import check_implementation_names

from .cli_options import add_config_options, config_from_args, registry_from_config


def add_parser(commands) -> None:
    parser = commands.add_parser("config", help="validate and show the effective configuration")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print every setting with its source")
    add_config_options(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(run=run_show)


def run_show(args: argparse.Namespace) -> int:
    loaded = config_from_args(args)
    check_implementation_names(loaded.config, registry_from_config(loaded))
    if args.json:
        print(json.dumps([{"key": k, "value": v, "source": s} for k, v, s in loaded.rows()], indent=2))
        return 0
    table = Table("setting", "value", "source", title="kvforge configuration")
    for key, value, source in loaded.rows():
        table.add_row(escape(key), escape(json.dumps(value)), escape(source))  # a value may hold [brackets]
    Console().print(table)
    return 0
