"""`kvforge conformance` as a CI tool: it never hangs, a run that checks nothing fails,
a --plugin name that selects nothing says why, failure lines name the implementation,
check, case and seed, extra pytest arguments reach pytest, and --report writes the matrix."""

import builtins
import json

import pytest

from kvforge.conformance.conftest import CheckTimedOut, limited
from kvforge.conformance.runner import describe_error
from kvforge.conformance.selection import DEFAULT_TIME_LIMIT_S, TIME_LIMIT_ENV, time_limit
from kvforge.core import ConfigError
from tests import planted
from tests.conftest import policy_plugin
from tests.test_cli import kvforge

@pytest.fixture
def broken_site(tmp_path):
    """The planted scheduler policies (tests/planted/scheduler_policies.py) as an installed plugin."""
    return planted.expose(tmp_path / "planted-site")


def test_a_livelocking_policy_fails_the_queueing_check_instead_of_hanging(broken_site, tmp_path):
    result = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "always-preempts", "--", "-k", "queue",
                     env=broken_site, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "so the policy livelocks" in result.stdout and "guarantee 4" in result.stdout


def test_a_hanging_check_fails_at_its_time_limit_and_the_rest_of_its_checks_at_once(broken_site, tmp_path):
    result = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "never-returns", "--time-limit", "1",
                     "--", "-k", "waiting_order", env=broken_site, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL never-returns ")]
    assert len(fails) == 5  # -k reached pytest: one check, five seeds
    assert "ran past its time limit of 1 s" in fails[0]
    assert all("[never-returns-0] of never-returns ran past its time limit, so never-returns's remaining checks fail"
               in line for line in fails[1:])


def test_extra_args_reach_pytest(broken_site, tmp_path):
    result = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "always-preempts", "--", "-x",
                     env=broken_site, cwd=tmp_path)
    assert result.returncode == 1 and "stopping after 1 failures" in result.stdout
    assert len([line for line in result.stdout.splitlines() if line.startswith("FAIL always-preempts ")]) == 1


def test_time_limit_interrupts_a_loop_that_swallows_exceptions():
    with pytest.raises(CheckTimedOut, match="spin ran past its time limit of 0.2 s"):
        with limited(0.2, "spin"):
            while True:
                try:
                    pass
                except Exception:  # a check's own handler must not swallow the limit
                    pass
    with limited(0, "no limit"):
        pass


def test_time_limit_comes_from_the_environment_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv(TIME_LIMIT_ENV, raising=False)
    assert time_limit() == DEFAULT_TIME_LIMIT_S
    monkeypatch.setenv(TIME_LIMIT_ENV, "2.5")
    assert time_limit() == 2.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(TIME_LIMIT_ENV, bad)
        with pytest.raises(ConfigError, match="seconds >= 0"):
            time_limit()


def test_nothing_checked_is_a_failure_for_kind_and_plugin(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    none = kvforge("conformance", "--kind", "quantizer", env={"KVFORGE_PLUGINS": "-quantizers"}, cwd=tmp_path)
    assert none.returncode == 5, none.stdout + none.stderr
    assert "no quantizer implementation is selected" in none.stdout
    typo = kvforge("conformance", "--plugin", "fcsf", cwd=tmp_path)
    assert typo.returncode == 5 and "did you mean 'fcfs'" in typo.stdout
    other_kind = kvforge("conformance", "--kind", "block_allocator", "--plugin", "fcfs", cwd=tmp_path)
    assert other_kind.returncode == 5 and "'fcfs' is a scheduler_policy" in other_kind.stdout
    deselected = kvforge("conformance", "--kind", "scheduler_policy", "--", "-k", "no_check_has_this_name", cwd=tmp_path)
    assert deselected.returncode == 5 and "no check ran" in deselected.stdout


def test_a_plugin_that_failed_to_load_or_is_a_disabled_duplicate_says_why(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('missing dependency foo')"},
                  {"bad": "fakeplug_bad"})
    fake_site.add("fakeplug-one", "1.0", {"fakeplug_one": policy_plugin("twin")}, {"one": "fakeplug_one"})
    fake_site.add("fakeplug-two", "2.0", {"fakeplug_two": policy_plugin("twin")}, {"two": "fakeplug_two"})
    env = {"PYTHONPATH": str(fake_site.root)}
    bad = kvforge("conformance", "--plugin", "bad", env=env, cwd=tmp_path)
    assert bad.returncode == 5 and "missing dependency foo" in bad.stdout, bad.stdout + bad.stderr
    twin = kvforge("conformance", "--plugin", "twin", env=env, cwd=tmp_path)
    assert twin.returncode == 5 and "fakeplug-one" in twin.stdout and "fakeplug-two" in twin.stdout
    assert "deny one" in twin.stdout


def test_failure_lines_name_implementation_check_case_and_seed_once_each(fake_site, tmp_path):
    fake_site.add("fakeplug-lifo", "1.0", {"fakeplug_lifo": policy_plugin("lifo")}, {"lifo": "fakeplug_lifo"})
    report = tmp_path / "out" / "report.md"
    result = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "lifo", "--seed", "4242",
                     "--report", str(report), env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert lines and len(lines) == len(set(lines))
    for line in lines:
        assert line.startswith("FAIL lifo check_scheduler_policy") and "::test_" in line
        assert "[lifo-" in line and "seed=4242: " in line and not line.rstrip().endswith(":")
    text = report.read_text()
    assert "seed 4242" in text and "| lifo | fakeplug-lifo 1.0 |" in text and "## Failures" in text


def test_a_passing_run_prints_its_seed_reports_json_and_passes_pytest_args(tmp_path):
    report = tmp_path / "report.json"
    result = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "fcfs", "--report", str(report),
                     "--", "-v", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout  # -v reached pytest
    data = json.loads(report.read_text())
    assert f"replay this run with --seed {data['seed']}" in result.stdout
    assert data["schema"] == 1 and data["exit_code"] == 0 and data["kvforge_version"]
    assert data["implementations"] == [{"kind": "scheduler_policy", "name": "fcfs", "plugin": "scheduler-policies",
                                        "distribution": "kvforge", "version": data["kvforge_version"]}]
    statuses = {r["group"]: r["status"] for r in data["results"]}
    assert statuses == {"ordering": "pass", "queueing": "pass"}
    assert all(r["duration_s"] >= 0 and r["passed"] > 0 for r in data["results"])


def test_collect_only_ids_name_the_module(tmp_path):
    result = kvforge("conformance", "--kind", "scheduler_policy", "--", "--collect-only", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert ids and all(line.startswith(("check_scheduler_policy.py::", "check_scheduler_policy_queue.py::"))
                       for line in ids)


def test_report_refuses_an_unknown_format(tmp_path):
    result = kvforge("conformance", "--report", "matrix.csv", cwd=tmp_path)
    assert result.returncode == 2 and ".json or .md" in result.stderr


@pytest.mark.skipif(not hasattr(builtins, "ExceptionGroup"), reason="exception groups need Python 3.11")
def test_a_hypothesis_group_of_failures_is_one_line_naming_each():
    with pytest.raises(builtins.ExceptionGroup) as group:
        raise builtins.ExceptionGroup("Hypothesis found 2 distinct failures.", [AssertionError("a broke"), KeyError("b")])
    line = describe_error(group)
    assert line == "2 distinct failures: AssertionError: a broke | KeyError: 'b'"
    with pytest.raises(AssertionError) as empty:
        raise AssertionError  # no message: the line names where and what raised
    bare = describe_error(empty)
    assert "+---" not in line and "test_conformance_cli.py" in bare and "(raise AssertionError" in bare


def test_the_allocator_state_machine_follows_the_run_seed(monkeypatch):
    from kvforge.conformance.attention_cases import SEED_ENV
    from kvforge.conformance.pool_machine import run_pool_machine
    from kvforge.plugins.block_allocators import NoCacheAllocator

    calls = []

    class Recording(NoCacheAllocator):
        def allocate(self, count):
            calls.append(count)
            return super().allocate(count)

    def operations(seed: int) -> list[int]:
        monkeypatch.setenv(SEED_ENV, str(seed))
        calls.clear()
        run_pool_machine(Recording, max_examples=5)
        return list(calls)

    first = operations(1)
    assert first and operations(1) == first  # the same seed replays the same sequences
    assert operations(2) != first  # another seed explores others


def test_failures_get_short_tracebacks_then_one_summary_line_each_and_full_tracebacks_with_verbose(broken_site,
                                                                                                   tmp_path):
    args = ("conformance", "--kind", "scheduler_policy", "--plugin", "spares-the-last-request", "--", "-k", "victim")
    short = kvforge(*args, env=broken_site, cwd=tmp_path).stdout.splitlines()
    header = next(i for i, line in enumerate(short) if "failing check(s), one line each" in line)
    fails = [line for line in short[header + 1:] if line.startswith("FAIL spares-the-last-request ")]
    assert len(fails) == 5 and "full tracebacks with -v" in short[header]
    assert all("seed=" in line and "guarantee 3: choose_victim returned None for 1 running request(s)" in line
               for line in fails)
    assert max(i for i, line in enumerate(short) if line.startswith("E ")) < header  # the summary comes last
    assert not any(line.lstrip().startswith("def test_") for line in short)  # short: no source listing
    verbose = kvforge(*args[:-3], "-v", *args[-3:], env=broken_site, cwd=tmp_path).stdout
    assert "def test_victim_is_one_of_the_running_requests" in verbose and " FAILED " in verbose  # pytest -v
    assert "full tracebacks with -v" not in verbose and verbose.count("FAIL spares-the-last-request ") == 5


def test_a_group_that_does_not_apply_is_na_not_skipped_and_the_implementation_a_full_pass(tmp_path):
    report = tmp_path / "report.json"
    result = kvforge("conformance", "--kind", "quantizer", "--plugin", "int8", "--quick", "--report", str(report),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(report.read_text())
    static = next(r for r in data["results"] if r["group"] == "static scale")
    assert (static["status"], static["skipped"]) == ("n/a", 0) and static["not_applicable"] > 0
    assert data["summary"] == [{"kind": "quantizer", "implementations": 1, "pass": 1, "partial": 0, "fail": 0,
                                "skipped": 0}]
    matrix = result.stdout.split("kvforge conformance: quantizer", 1)[1]
    assert "n/a (dynamic" in matrix and "skipped" not in matrix


def test_markdown_cells_say_na_with_why_and_skipped_with_the_reason_that_is_not_na():
    from kvforge.conformance.report import markdown, report_data
    from kvforge.conformance.runner import ConformanceRun, GroupResult

    na = GroupResult("quantizer", "int8", "static scale", not_applicable=4,
                     skip_reasons=["not applicable: dynamic (absmax) scales"])
    mixed = GroupResult("quantizer", "int8", "roundtrip", skipped=1, not_applicable=1,
                        skip_reasons=["not applicable: x", "unavailable: needs CUDA"])
    run = ConformanceRun(0, [na, mixed], seed=1, time_limit_s=120, quick=False, started=0.0, duration_s=1.0)
    text = markdown(report_data(run, 0, []))
    assert "| n/a (dynamic (absmax) scales) |" in text.replace("| skipped (unavailable: needs CUDA) ", "")
    assert "skipped (unavailable: needs CUDA)" in text
    assert [r["status"] for r in report_data(run, 0, [])["results"]] == ["n/a", "skipped"]


def test_report_summary_tells_a_partly_skipped_implementation_from_a_full_pass():
    from kvforge.conformance.report import summary
    from kvforge.conformance.runner import ConformanceRun, GroupResult

    def group(name, group_name, passed=0, failed=0, skipped=0):
        return GroupResult("attention_backend", name, group_name, passed=passed, failed=failed, skipped=skipped)

    results = [group("full", "decode", passed=3), group("full", "refusal", passed=1),
               group("unavailable", "decode", skipped=3), group("unavailable", "refusal", passed=1),
               group("broken", "decode", passed=2, failed=1), group("absent", "decode", skipped=3),
               group("narrow", "decode", passed=3), GroupResult("attention_backend", "narrow", "fp8", not_applicable=2)]
    run = ConformanceRun(1, results, seed=1, time_limit_s=120, quick=True, started=0.0, duration_s=1.0)
    # "narrow" passes all that applies to it: its n/a group does not make it partial
    assert summary(run) == [{"kind": "attention_backend", "implementations": 5, "pass": 2, "partial": 1, "fail": 1,
                             "skipped": 1}]
