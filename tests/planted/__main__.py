"""`python -m tests.planted [--report FILE.json|FILE.md] [--time-limit S] [--seed N] [--full]`,
from a checkout: run the conformance suite (its quick grid unless --full, with
--fail-fast: one failure catches a bug) on every planted bug and print, per kind,
how many it caught; exit 1 when it missed one.

A bug counts as caught when a check fails it for a reason other than the time limit,
except for the planted hangs (`hangs = True`), which only the time limit can end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import PLANTED, PLUGIN, expose

TIMED_OUT = "ran past its time limit"  # what conformance/conftest.py says of a check it stopped


@dataclass
class Tally:
    """How one kind's planted bugs fared: `missed` holds (name, why) of each not caught."""

    planted: int = 0
    missed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def caught(self) -> int:
        return self.planted - len(self.missed)


def run_suite(report: Path, site: Path, time_limit_s: float, quick: bool = True, seed: int | None = None,
              timeout_s: float = 900) -> subprocess.CompletedProcess:
    """`kvforge conformance --plugin planted` in a fresh process, its JSON report at `report`."""
    args = [sys.executable, "-m", "kvforge", "conformance", "--plugin", PLUGIN, "--fail-fast",
            "--time-limit", f"{time_limit_s:g}",
            "--report", str(report), *(["--quick"] if quick else []), *(["--seed", str(seed)] if seed is not None else [])]
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVFORGE_")}
    env |= {"COLUMNS": "200", "OMP_NUM_THREADS": "1", **expose(site)}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s)


def tally(data: dict) -> dict[str, Tally]:
    """Caught/planted per kind from a conformance report (schema 1)."""
    results = {}
    for r in data["results"]:
        results.setdefault((r["kind"], r["implementation"]), []).append(r)
    tallies = {}
    for kind, classes in PLANTED.items():
        kind_tally = tallies[kind] = Tally(planted=len(classes))
        for cls in classes:
            mine = results.get((kind, cls.name), [])
            messages = [f["message"] for r in mine for f in r["failures"]]
            if getattr(cls, "hangs", False) and messages:
                continue
            if any(TIMED_OUT not in message for message in messages):
                continue
            if messages:
                why = "failed only at the time limit"
            elif mine:
                skipped = "; ".join(dict.fromkeys(reason for r in mine for reason in r["skip_reasons"]))
                why = f"skipped ({skipped})" if not any(r["passed"] for r in mine) else "passed every check"
            else:
                why = "never checked"
            kind_tally.missed.append((cls.name, why))
    return tallies


def summary(tallies: dict[str, Tally]) -> list[str]:
    lines = [f"{kind}: caught {t.caught} of {t.planted} planted bugs" for kind, t in tallies.items()]
    lines += [f"MISSED {kind} {name}: {why}" for kind, t in tallies.items() for name, why in t.missed]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.planted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="also keep the conformance report, FILE.json or FILE.md")
    parser.add_argument("--time-limit", type=float, default=30.0, help="per-check time limit (default 30 s)")
    parser.add_argument("--seed", type=int, help="the run's seed (default: a fresh one, printed)")
    parser.add_argument("--full", action="store_true", help="the full grid instead of --quick")
    args = parser.parse_args(argv)
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
