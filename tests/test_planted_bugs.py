"""Proof for every kind: the whole conformance suite, run as `kvforge conformance --quick
--fail-fast` on every planted bug in tests/planted/, catches each one, within its
time limit, for a reason other than the limit itself (but for the planted hang, which
only the limit can end). The report states caught/planted per kind."""

from __future__ import annotations

import json

from kvforge.core import KINDS
from tests.planted import PLANTED
from tests.planted.proof import TIMED_OUT, Tally, run_suite, summary, tally

TIME_LIMIT_S = 20  # 6x the slowest planted check measured on 2 shared CPU cores; the hang waits it out asleep


def test_every_planted_bug_of_every_kind_is_caught_within_its_time_limit(tmp_path):
    report = tmp_path / "planted.json"
    result = run_suite(report, tmp_path / "site", TIME_LIMIT_S)
    assert report.exists(), result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert result.returncode == 1 and data["exit_code"] == 1
    assert not data["problems"]  # every planted implementation registered and was checked
    tallies = tally(data)
    missed = [line for line in summary(tallies) if line.startswith("MISSED")]
    assert not missed, f"seed {data['seed']}: " + "; ".join(missed)
    # the report itself says it too: every planted implementation of every kind fails
    assert {row["kind"]: (row["fail"], row["implementations"]) for row in data["summary"]} == {
        kind: (len(classes), len(classes)) for kind, classes in PLANTED.items()}
    hangs = [cls.name for classes in PLANTED.values() for cls in classes if getattr(cls, "hangs", False)]
    for name in hangs:  # ended by the limit, after one limit
        messages = [f["message"] for r in data["results"] if r["implementation"] == name for f in r["failures"]]
        assert any(f"{TIMED_OUT} of {TIME_LIMIT_S:g} s" in m for m in messages), messages
    slow = [(r["implementation"], f["check"]) for r in data["results"] if r["implementation"] not in hangs
            for f in r["failures"] if TIMED_OUT in f["message"]]
    assert not slow, f"seed {data['seed']}: checks that reached the time limit: {slow}"


def test_there_are_planted_bugs_of_every_kind_each_named_once_and_described():
    assert set(PLANTED) == set(KINDS)
    names = [(kind, cls.name) for kind, classes in PLANTED.items() for cls in classes]
    assert len(names) == len(set(names))
    assert all(cls.kind == kind and cls.__doc__ for kind, classes in PLANTED.items() for cls in classes)


def result(implementation: str, status: str, messages=(), skip_reasons=()) -> dict:
    return {"kind": "scheduler_policy", "implementation": implementation, "group": "ordering", "status": status,
            "passed": int(status == "pass"), "failed": len(messages), "skipped": int(status == "skipped"),
            "duration_s": 0.0, "skip_reasons": list(skip_reasons),
            "failures": [{"check": "c", "case": "x", "message": m} for m in messages]}


def test_the_tally_counts_a_bug_caught_only_by_a_failing_check():
    # planted bugs that pass, only skip, are never checked, or fail only at the time limit are missed
    lcfs, tie, progress, victim, spares, preempts, hang = (cls.name for cls in PLANTED["scheduler_policy"])
    data = {"results": [
        result(lcfs, "fail", ["AssertionError: two distinct requests compare equal"]),
        result(tie, "pass"),
        result(hang, "fail", [f"CheckTimedOut: x {TIMED_OUT} of 20 s"]),
        result(progress, "fail", [f"CheckTimedOut: x {TIMED_OUT} of 20 s", f"(setup) Failed: not run: {TIMED_OUT}"]),
        result(victim, "skipped", skip_reasons=["unavailable: needs CUDA"]),
    ]}
    tallies = tally(data)
    assert tallies["scheduler_policy"].missed == [(tie, "passed every check"),
                                                  (progress, "failed only at the time limit"),
                                                  (victim, "skipped (unavailable: needs CUDA)"),
                                                  (spares, "never checked"), (preempts, "never checked")]
    assert getattr(PLANTED["scheduler_policy"][-1], "hangs", False)
    assert tallies["scheduler_policy"].caught == 2  # lcfs by a check, the planted hang by the limit
    assert tallies["quantizer"] == Tally(planted=len(PLANTED["quantizer"]),
                                         missed=[(cls.name, "never checked") for cls in PLANTED["quantizer"]])
