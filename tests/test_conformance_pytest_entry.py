"""The pytest entry of the conformance suite, run as a plugin author's CI runs it: a
separate `pytest --pyargs kvforge.conformance --kvforge-...` process started outside
the repository. It passes a conformant implementation, fails a planted bug with the
CLI's failure lines, stops with the CLI's reason on a name that selects nothing,
exits 5 when it checked nothing, turns off with `-p no:kvforge`, and leaves the
repository's own test run as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvforge.cli import main
from kvforge.conformance import selection
from kvforge.conformance.attention_cases import target
from kvforge.core import ATTENTION_BACKEND, BLOCK_ALLOCATOR, Registration, build_registry
from tests import planted

REPO = Path(__file__).resolve().parents[1]


def pytest_entry(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # the outer run's own choices (its seed, its quick flag) must not leak into the run under test
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("KVFORGE_", "PYTEST_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env={**clean, "COLUMNS": "250", **(env or {})})


def test_a_conformant_builtin_passes_prints_its_seed_and_writes_the_report(tmp_path):
    report = tmp_path / "report.json"
    result = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-plugin", "fcfs", "--kvforge-seed", "11",
                          "--kvforge-report", str(report), "-rs", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 11: replay this run with --kvforge-seed 11" in result.stdout
    assert "empty parameter set" not in result.stdout  # the other kinds' groups are not even collected
    data = json.loads(report.read_text())
    assert data["seed"] == 11 and data["exit_code"] == 0
    assert {(r["implementation"], r["group"], r["status"]) for r in data["results"]} == {
        ("fcfs", "ordering", "pass"), ("fcfs", "queueing", "pass")}
    assert data["summary"] == [{"kind": "scheduler_policy", "implementations": 1, "pass": 1, "partial": 0, "fail": 0,
                                "skipped": 0}]


def test_a_planted_bug_fails_with_the_cli_failure_line_and_fail_fast_stops_it_there(tmp_path):
    result = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-plugin", "last-come-first-served",
                          "--kvforge-seed", "3", "--kvforge-fail-fast", "-rs", cwd=tmp_path,
                          env=planted.expose(tmp_path / "site"))
    assert result.returncode == 1, result.stdout + result.stderr
    (fail,) = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert fail.startswith("FAIL last-come-first-served check_scheduler_policy::test_waiting_order_is_total_and_"
                           "breaks_ties_by_arrival[last-come-first-served-0] seed=3: AssertionError")
    assert "not run: last-come-first-served failed test_waiting_order_is_total_and_breaks_ties_by_arrival " \
           "(--fail-fast)" in result.stdout


def test_names_that_select_nothing_stop_the_run_with_the_cli_reasons(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('missing dependency foo')"},
                  {"bad": "fakeplug_bad"})
    result = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-plugin", "fcsf", "--kvforge-plugin", "bad",
                          cwd=tmp_path, env={"PYTHONPATH": str(fake_site.root)})
    assert result.returncode == 5, result.stdout + result.stderr
    assert "--kvforge-plugin 'fcsf' selects nothing" in result.stderr and "did you mean 'fcfs'?" in result.stderr
    assert "--kvforge-plugin 'bad' selects nothing" in result.stderr
    assert "failed at import: ImportError: missing dependency foo" in result.stderr


def test_the_reasons_quote_the_options_of_the_entry_that_asked():
    for options in ("--", "--kvforge-"):
        plugin, kind = selection.unmatched([BLOCK_ALLOCATOR], ["fcfs"], options)
        assert plugin.startswith(f"{options}plugin 'fcfs' selects nothing")
        assert f"'fcfs' is a scheduler_policy, and only {options}kind block_allocator runs" in plugin
        assert kind.startswith(f"{options}kind block_allocator checks nothing")


def test_a_run_that_checked_nothing_exits_5_where_plain_pytest_would_pass(tmp_path):
    # fcfs skips the priority policy's own promise: one check selected, skipped, nothing certified
    skipped = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-plugin", "fcfs", "-k", "test_priority",
                           cwd=tmp_path)
    assert skipped.returncode == 5, skipped.stdout + skipped.stderr
    assert "nothing checked: no check ran: every selected check was skipped" in skipped.stdout
    no_suite = pytest_entry("--kvforge-plugin", "fcfs", cwd=tmp_path)  # the suite was not named
    assert no_suite.returncode == 5 and "no conformance check was collected" in no_suite.stdout


def test_kind_collects_only_that_kinds_groups(tmp_path):
    result = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-kind", "scheduler_policy", "--co", "-q",
                          cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    groups = ("check_scheduler_policy.py", "check_scheduler_policy_queue.py")
    assert ids and all(Path(line.split("::")[0]).name in groups for line in ids)


def test_p_no_kvforge_turns_the_plugin_off(tmp_path):
    result = pytest_entry("-p", "no:kvforge", "--pyargs", "kvforge.conformance", "--kvforge-plugin", "fcfs",
                          cwd=tmp_path)
    assert result.returncode == 4 and "unrecognized arguments: --kvforge-plugin" in result.stderr


def test_the_repository_run_collects_the_same_checks_with_and_without_the_plugin():
    with_plugin = pytest_entry("--co", "-q", "conformance", cwd=REPO)
    without = pytest_entry("-p", "no:kvforge", "--co", "-q", "conformance", cwd=REPO)
    assert with_plugin.returncode == 0 == without.returncode, with_plugin.stdout + with_plugin.stderr

    def ids(run):
        return [line for line in run.stdout.splitlines() if "::" in line]

    assert ids(with_plugin) and ids(with_plugin) == ids(without)
    assert len(ids(with_plugin)) == len(set(ids(with_plugin)))  # no module collected twice


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is present")
def test_cuda_without_a_gpu_is_refused_at_once_by_both_entries(tmp_path, capsys):
    entry = pytest_entry("--pyargs", "kvforge.conformance", "--kvforge-device", "cuda", cwd=tmp_path)
    assert entry.returncode == 4 and "--kvforge-device cuda: device 'cuda' was asked for" in entry.stderr
    assert main(["conformance", "--device", "cuda"]) == 2
    error = capsys.readouterr().err
    assert "--device cuda: device 'cuda' was asked for" in error
    assert "sees no GPU here" in error and "leave --device out" in error


def test_the_device_a_run_asks_for_reaches_the_attention_checks(monkeypatch):
    registration = build_registry(environ={}).get(ATTENTION_BACKEND, "reference")
    monkeypatch.setenv(selection.DEVICE_ENV, "cpu")
    assert target(registration).device == "cpu"
    monkeypatch.setenv(selection.DEVICE_ENV, "tpu")
    with pytest.raises(pytest.fail.Exception, match="device 'tpu' is not one of cpu, cuda"):
        target(registration)
    cpu_only = type("CpuOnly", (registration.cls,), {"name": "cpu-only", "devices": frozenset({"cpu"})})
    monkeypatch.setenv(selection.DEVICE_ENV, "cuda")
    expected = "not 'cuda'" if torch.cuda.is_available() else "sees no GPU here"
    with pytest.raises((pytest.skip.Exception, pytest.fail.Exception), match=expected):
        target(Registration(ATTENTION_BACKEND, "cpu-only", cpu_only, "test", "test", "0", (1, 0)))
