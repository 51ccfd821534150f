"""`python -m tests.planted [--report FILE.json|FILE.md] [--time-limit S] [--seed N] [--full]`,
from a checkout: run the conformance suite (its quick grid unless --full, with
--fail-fast: one failure catches a bug) on every planted bug and print, per kind,
how many it caught; exit 1 when it missed one (see proof.py for what counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .proof import run_suite, summary, tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.planted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="also keep the conformance report, FILE.json or FILE.md")
    parser.add_argument("--time-limit", type=float, default=30.0, help="per-check time limit (default 30 s)")
    parser.add_argument("--seed", type=int, help="the run's seed (default: a fresh one, printed)")
    parser.add_argument("--full", action="store_true", help="the full grid instead of --quick")
    args = parser.parse_args(argv)
    if args.report and not args.report.endswith((".json", ".md")):
        parser.error(f"--report {args.report!r} must end in .json or .md")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "planted.json"
        result = run_suite(report, Path(scratch) / "site", args.time_limit, not args.full, args.seed)
        if not report.exists():
            print(result.stdout + result.stderr, file=sys.stderr)
            return 2
        data = json.loads(report.read_text())
    lines = summary(tally(data))
    print(f"kvforge conformance on the planted bugs, seed {data['seed']}, {data['duration_s']:.0f} s:")
    print("\n".join(lines))
    if args.report:
        from kvforge.conformance.report import markdown

        text = json.dumps(data, indent=2) if args.report.endswith(".json") else (
            markdown(data) + "\n## Planted bugs\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
        Path(args.report).write_text(text)
    return 1 if any(t.missed for t in tally(data).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
