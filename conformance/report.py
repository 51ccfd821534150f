"""`kvforge conformance --report FILE.json|FILE.md`: the matrix of a run as a file a CI
job keeps. The JSON layout (schema 1) is documented in docs/cli.md."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from kvforge.core import API_VERSION

from .applicability import NOT_APPLICABLE, is_not_applicable
from .runner import ConformanceRun

SCHEMA = 1
FORMATS = (".json", ".md")


def report_data(run: ConformanceRun, exit_code: int, problems: list[str]) -> dict:
    """Schema 1: fields may be added in a later schema, never renamed or removed within one."""
    implementations = {}
    for r in run.results:
        implementations.setdefault((r.kind, r.implementation), {
            "kind": r.kind, "name": r.implementation, "plugin": r.plugin,
            "distribution": r.distribution, "version": r.version})
    return {
        "schema": SCHEMA,
        "kvforge_version": metadata.version("kvforge"),
        "api_version": list(API_VERSION),
        "seed": run.seed,
        "quick": run.quick,
        "time_limit_s": run.time_limit_s,
        "started": datetime.fromtimestamp(run.started, timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(run.duration_s, 3),
        "exit_code": exit_code,
        "problems": problems,
        "implementations": list(implementations.values()),
        "summary": summary(run),
        "results": [{
            "kind": r.kind, "implementation": r.implementation, "group": r.group, "status": r.status,
            "passed": r.passed, "failed": r.failed, "skipped": r.skipped, "not_applicable": r.not_applicable,
            "duration_s": round(r.duration_s, 3),
            "skip_reasons": r.skip_reasons,
            "failures": [{"check": f.check, "case": f.case, "message": f.message} for f in r.failures],
        } for r in run.results],
    }


def summary(run: ConformanceRun) -> list[dict]:
    """Per kind, how many implementations passed (every group that applies passed),
    passed in part (none failed, some were only skipped: a backend unavailable here
    still passes its refusal checks), failed (a group failed) or were only skipped.
    A group that does not apply ("n/a") counts for nothing either way. Run on planted
    bugs, `failed` is caught/planted."""
    status: dict[tuple[str, str], set[str]] = {}
    for r in run.results:
        applies = status.setdefault((r.kind, r.implementation), set())
        if r.status != "n/a":
            applies.add(r.status)
    counts: dict[str, dict] = {}
    for (kind, _), statuses in status.items():
        verdict = ("fail" if "fail" in statuses else "skipped" if "pass" not in statuses
                   else "partial" if "skipped" in statuses else "pass")
        row = counts.setdefault(kind, {"kind": kind, "implementations": 0, "pass": 0, "partial": 0, "fail": 0,
                                       "skipped": 0})
        row["implementations"] += 1
        row[verdict] += 1
    return list(counts.values())


def cell_reason(status: str, reasons: list[str]) -> str:
    """The reason a matrix cell of `status` shows: for "n/a", why the group does not
    apply; for "skipped", the first reason that is not a "does not apply"."""
    if status == "n/a":
        return reasons[0].removeprefix(f"{NOT_APPLICABLE}: ")
    return next((r for r in reasons if not is_not_applicable(r)), reasons[0])


def write_report(path: str | Path, run: ConformanceRun, exit_code: int, problems: list[str]) -> Path:
    """Write the report, JSON or Markdown by the file's suffix."""
    path = Path(path)
    data = report_data(run, exit_code, problems)
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    elif path.suffix == ".md":
        text = markdown(data)
    else:
        raise ValueError(f"--report {str(path)!r}: the file must end in {' or '.join(FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def markdown(data: dict) -> str:
    lines = ["# kvforge conformance report", "",
             f"kvforge {data['kvforge_version']} (API {'.'.join(map(str, data['api_version']))}), "
             f"seed {data['seed']}{' (quick grid)' if data['quick'] else ''}, started {data['started']}, "
             f"{data['duration_s']:.1f} s, per-check time limit {data['time_limit_s']:g} s, exit code {data['exit_code']}.",
             ""]
    lines += [f"- **problem**: {p}" for p in data["problems"]]
    versions = {(i["kind"], i["name"]): f"{i['distribution']} {i['version']}" for i in data["implementations"]}
    counts = {row["kind"]: row for row in data["summary"]}
    for kind in dict.fromkeys(r["kind"] for r in data["results"]):
        of_kind = [r for r in data["results"] if r["kind"] == kind]
        groups = sorted({r["group"] for r in of_kind})
        cells = {(r["implementation"], r["group"]): r for r in of_kind}
        row = counts[kind]
        lines += ["", f"## {kind}", "", f"{row['implementations']} implementation(s): {row['pass']} pass, "
                  f"{row['partial']} pass with groups skipped, {row['fail']} fail, {row['skipped']} only skipped "
                  "(n/a: the group does not apply to the implementation).",
                  "", "| implementation | from | " + " | ".join(groups) + " |", "|---|---|" + "---|" * len(groups)]
        for name in dict.fromkeys(r["implementation"] for r in of_kind):
            row = []
            for group in groups:
                r = cells.get((name, group))
                if r is None:
                    row.append("-")
                elif r["status"] in ("skipped", "n/a") and r["skip_reasons"]:
                    row.append(f"{r['status']} ({cell_reason(r['status'], r['skip_reasons'])})")
                else:
                    row.append(f"{r['status']} ({r['duration_s']:.1f} s)")
            lines.append(f"| {name} | {versions[(kind, name)]} | " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    failures = [(r["implementation"], f) for r in data["results"] for f in r["failures"]]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- `{name}` `{f['check']}[{f['case']}]` seed {data['seed']}: {f['message']}" for name, f in failures]
    return "\n".join(lines) + "\n"
