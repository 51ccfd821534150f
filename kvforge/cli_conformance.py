"""`kvforge conformance`: run the shared suite and print implementation × check group."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvforge.core import KINDS


def add_parser(commands) -> None:
    parser = commands.add_parser("conformance", help="run the shared conformance suite against registered implementations")
    parser.add_argument("--kind", action="append", choices=KINDS, help="only this kind (repeatable)")
    parser.add_argument("--plugin", action="append", help="only this implementation or plugin name (repeatable)")
    parser.add_argument("--quick", action="store_true", help="the reduced grid")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvforge.conformance import run_conformance

    code, results = run_conformance(args.kind, args.plugin, args.quick, args.pytest_args)
    console = Console()
    if not results:
        console.print("no conformance checks matched the selection")
        return 1 if args.plugin else int(code not in (0, 5))
    style = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skipped": "[yellow]skipped[/yellow]"}
    for kind in dict.fromkeys(r.kind for r in results):
        of_kind = [r for r in results if r.kind == kind]
        groups = sorted({r.group for r in of_kind})
        names = list(dict.fromkeys(r.implementation for r in of_kind))
        # one table per kind keeps the matrix narrow; names never wrap or get cut
        table = Table(title=f"kvforge conformance: {kind}")
        table.add_column("implementation", no_wrap=True, min_width=max(len(n) for n in names))
        for group in groups:
            table.add_column(group, overflow="fold")
        cells = {(r.implementation, r.group): r for r in of_kind}
        for name in names:
            row = []
            for group in groups:
                result = cells.get((name, group))
                if result is None:
                    row.append("-")
                    continue
                cell = style[result.status]
                if result.status == "skipped" and result.skip_reasons:
                    cell += f" ({result.skip_reasons[0]})"
                row.append(cell)
            table.add_row(name, *row)
        console.print(table)
    for result in results:
        for failure in result.failures:
            console.print(f"[red]FAIL[/red] {escape(failure)}")  # test ids hold [params], not markup
    failed = any(r.status == "fail" for r in results)
    return 1 if failed or code not in (0, 5) else 0
