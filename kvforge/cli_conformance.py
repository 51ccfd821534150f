"""`kvforge conformance`: run the shared suite and print implementation × check group."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvforge.core import KINDS


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "conformance", help="run the shared conformance suite against registered implementations",
        description="Exit status: 0 every selected check passed; 1 a check failed; "
                    "5 nothing was checked (no implementation selected, a --plugin name matching "
                    "nothing, or every check skipped); 2 a bad option (--device cuda where torch sees no GPU).")
    parser.add_argument("--kind", action="append", choices=KINDS, help="only this kind (repeatable)")
    parser.add_argument("--plugin", action="append", help="only this implementation or plugin name (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="each kind's reduced grid: the same checks on fewer cases (attention: fixed batch shapes at one "
                             "block size; allocators: fewer random operation sequences, a smaller pool; quantizers: one "
                             "input shape per granularity, two fixed scales; policies: 2 seeds of 5 (ordering), 1 of 3 "
                             "(queueing); proposers: 1 seed of 2, k = 4 only, the engine under prefix caching and "
                             "preemption only)")
    parser.add_argument("--seed", type=int, help="the seed every check draws from (default: a fresh one, printed; "
                                                 "or KVFORGE_CONFORMANCE_SEED)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="fail a check that runs longer (default 120, or KVFORGE_CONFORMANCE_TIME_LIMIT; 0: none)")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop checking an implementation at its first failing check (its other checks are "
                             "skipped, saying so); pytest's -x stops the whole run instead")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="where attention backends run (default: cuda where a GPU is present and the backend "
                             "declares it, else cpu); cuda without a GPU is an error")
    parser.add_argument("--report", metavar="FILE", help="also write the matrix to FILE.json or FILE.md")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="full tracebacks and one line per check (pytest -v); by default each failure gets a "
                             "short traceback, and the run ends with one summary line per failure")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --, e.g. -- -v -x")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvforge.conformance import report, runner, selection

    if args.report and not args.report.endswith(report.FORMATS):
        print(f"error: --report {args.report!r} must end in {' or '.join(report.FORMATS)}", file=sys.stderr)
        return 2
    if args.time_limit is not None and not args.time_limit >= 0:
        print(f"error: --time-limit {args.time_limit:g} must be seconds >= 0 (0 turns the limit off)", file=sys.stderr)
        return 2
    device_problem = selection.device_problem(args.device)
    if device_problem:
        print(f"error: --device {args.device}: {device_problem}", file=sys.stderr)
        return 2
    console = Console(soft_wrap=True)  # a failure line is one line in a CI log, never wrapped
    selection.registry.cache_clear()
    problems = selection.unmatched(args.kind, args.plugin)
    if problems:
        for problem in problems:
            console.print(f"[red]nothing checked[/red]: {escape(problem)}")
        if args.report:
            empty = runner.ConformanceRun(runner.NOTHING_CHECKED, [], runner.run_seed(args.seed),
                                          selection.time_limit(), args.quick, time.time(), 0.0)
            report.write_report(args.report, empty, runner.NOTHING_CHECKED, problems)
        return runner.NOTHING_CHECKED

    seed = runner.run_seed(args.seed)
    console.print(f"kvforge conformance: seed {seed}, per-check time limit "
                  f"{args.time_limit if args.time_limit is not None else selection.time_limit():g} s")
    pytest_args = (["-v"] if args.verbose else []) + list(args.pytest_args)
    result = runner.run_conformance(args.kind, args.plugin, args.quick, pytest_args, seed, args.time_limit,
                                    args.device, args.fail_fast)
    if {"--collect-only", "--co"} & set(args.pytest_args):
        return result.code
    print_matrix(console, result.results)
    lines = runner.failure_lines(result.results, result.seed)
    if lines:
        full = "" if args.verbose or "-v" in pytest_args else "; full tracebacks with -v"
        console.print(f"[bold]{len(lines)} failing check(s)[/bold], one line each "
                      + escape(f"(implementation, check[case], seed: what broke){full}:"))
    for line in lines:
        console.print(f"[red]FAIL[/red] {escape(line)}")
    problems = runner.unchecked(result.results, args.plugin)
    for problem in problems:
        console.print(f"[red]nothing checked[/red]: {escape(problem)}")
    failed = any(r.status == "fail" for r in result.results)
    code = 1 if failed or result.code not in (0, runner.NOTHING_CHECKED) else runner.NOTHING_CHECKED if problems else 0
    console.print(f"seed {result.seed}: replay this run with --seed {result.seed}")
    if args.report:
        console.print(f"report: {report.write_report(args.report, result, code, problems)}")
    return code


def print_matrix(console: Console, results) -> None:
    from kvforge.conformance.report import cell_reason

    style = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skipped": "[yellow]skipped[/yellow]",
             "n/a": "[dim]n/a[/dim]"}
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
                if result.status in ("skipped", "n/a") and result.skip_reasons:
                    cell += f" ({escape(cell_reason(result.status, result.skip_reasons))})"
                row.append(cell)
            table.add_row(name, *row)
        console.print(table)
