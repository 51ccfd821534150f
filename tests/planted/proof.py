"""Running the whole conformance suite on every planted bug, and counting what it caught.

A bug counts as caught when a check fails it for a reason other than the time limit,
except for the planted hangs (`hangs = True`), which only the time limit can end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.conformance.conftest import TIMED_OUT

from . import PLANTED, PLUGIN, expose


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
            "--report", str(report), *(["--quick"] if quick else []),
            *(["--seed", str(seed)] if seed is not None else [])]
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
