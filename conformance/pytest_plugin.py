"""The pytest entry of the conformance suite, registered as the pytest plugin `kvforge`:

    pytest --pyargs kvforge.conformance --kvforge-plugin NAME [--kvforge-kind KIND] [--kvforge-quick]
           [--kvforge-seed N] [--kvforge-time-limit S] [--kvforge-fail-fast] [--kvforge-device cuda]
           [--kvforge-report FILE.json|FILE.md]

certifies an implementation in a plugin's own CI without a line of test code. The
options are `kvforge conformance`'s and travel the same way, through
`runner.run_environment` into the environment the checks read, so a pytest run and
a CLI run with the same choices and seed check the same cases. A name that selects
nothing stops the run with the CLI's reason (its load error, the duplicate that
disabled it, or a "did you mean"), and a run that checked nothing exits 5, pytest's
"no tests ran", as `kvforge conformance` does.

Without a `--kvforge-*` option the plugin only lets the suite's `check_*.py` modules
be collected wherever pytest runs (a project's `python_files` rarely names them);
`-p no:kvforge` turns it off.
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from pathlib import Path

import pytest

from kvforge.core import KINDS

from . import report, runner, selection

SUITE_DIR = Path(__file__).parent
OPTIONS = "--kvforge-"  # the prefix of this entry's options, quoted in its messages
_RUN = pytest.StashKey["ConformanceSession"]()


def pytest_addoption(parser):
    group = parser.getgroup("kvforge", "kvforge conformance (pytest --pyargs kvforge.conformance ...)")
    group.addoption("--kvforge-plugin", action="append", metavar="NAME",
                    help="check only this implementation or plugin (entry-point) name; repeatable")
    group.addoption("--kvforge-kind", action="append", choices=KINDS, metavar="KIND",
                    help=f"check only this kind ({', '.join(KINDS)}); repeatable")
    group.addoption("--kvforge-quick", action="store_true", default=False, help="each kind's reduced grid")
    group.addoption("--kvforge-seed", type=int, metavar="N",
                    help="the seed every check draws from (default: a fresh one, printed in the summary)")
    group.addoption("--kvforge-time-limit", type=float, metavar="SECONDS",
                    help=f"fail a check that runs longer (default {selection.DEFAULT_TIME_LIMIT_S:g}; 0: none)")
    group.addoption("--kvforge-fail-fast", action="store_true", default=False,
                    help="stop checking an implementation at its first failing check")
    group.addoption("--kvforge-device", choices=selection.DEVICES,
                    help="where attention backends run (default: cuda where present, else cpu)")
    group.addoption("--kvforge-report", metavar="FILE", help="also write the matrix to FILE.json or FILE.md")


class ConformanceSession:
    """The choices of one pytest run that asked for the suite through `--kvforge-*`, and what it found."""

    def __init__(self, config):
        option = config.option
        self.plugins: list[str] | None = option.kvforge_plugin
        self.kinds: list[str] | None = option.kvforge_kind
        self.quick: bool = option.kvforge_quick
        self.time_limit_s: float | None = option.kvforge_time_limit
        self.device: str | None = option.kvforge_device
        self.fail_fast: bool = option.kvforge_fail_fast
        self.collect_only: bool = option.collectonly
        self.report_path: str | None = option.kvforge_report
        self._refuse_nonsense()
        self.seed = runner.run_seed(option.kvforge_seed)
        self.started = time.time()
        self.modules: dict[str, tuple[str, str]] = {}  # check module name -> (kind, group), once begun
        self.collector = runner.Collector(self.modules)
        self.problems: list[str] = []
        self.exit_code = 0
        self._environment = contextlib.ExitStack()

    def _refuse_nonsense(self) -> None:
        if self.report_path and not self.report_path.endswith(report.FORMATS):
            raise pytest.UsageError(f"--kvforge-report {self.report_path!r} must end in {' or '.join(report.FORMATS)}")
        if self.time_limit_s is not None and not self.time_limit_s >= 0:
            raise pytest.UsageError(f"--kvforge-time-limit {self.time_limit_s:g} must be seconds >= 0 "
                                    "(0 turns the limit off)")
        problem = selection.device_problem(self.device)
        if problem:
            raise pytest.UsageError(f"--kvforge-device {self.device}: {problem}")

    def begin(self) -> None:
        """Put the run's choices where the checks read them, and find the check groups it runs."""
        self._environment.enter_context(runner.run_environment(
            self.plugins, self.quick, self.seed, self.time_limit_s, self.device, self.fail_fast))
        selection.registry.cache_clear()
        self.modules.update({name: (kind, group) for name, kind, group in runner.selected_check_modules(self.kinds)})

    def end(self) -> None:
        self._environment.close()

    def finish(self, exitstatus: int) -> int:
        """The run's exit code once every check ran: 5 where it checked nothing it was asked to."""
        if self.collect_only:
            return exitstatus
        results = self.collector.sorted_results()
        if self.collector.registration_of:
            self.problems = runner.unchecked(results, self.plugins, OPTIONS)
        else:
            self.problems = ["no conformance check was collected: name the suite, "
                             "`pytest --pyargs kvforge.conformance --kvforge-plugin NAME`"]
        self.exit_code = runner.NOTHING_CHECKED if self.problems and exitstatus == 0 else exitstatus
        self.write_report(results)
        return self.exit_code

    def write_report(self, results: list[runner.GroupResult]) -> None:
        if self.report_path:
            run = runner.ConformanceRun(self.exit_code, results, self.seed, selection.time_limit(), self.quick,
                                        self.started, time.time() - self.started)
            report.write_report(self.report_path, run, self.exit_code, self.problems)


def _active(config) -> ConformanceSession | None:
    return config.stash.get(_RUN, None)


def _asked_for(config) -> bool:
    option = config.option
    return bool(option.kvforge_plugin or option.kvforge_kind or option.kvforge_quick or option.kvforge_report
                or option.kvforge_fail_fast or option.kvforge_device
                or option.kvforge_seed is not None or option.kvforge_time_limit is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not _asked_for(config):
        return
    run = ConformanceSession(config)
    run.begin()
    config.stash[_RUN] = run
    config.pluginmanager.register(run.collector, "kvforge-conformance-results")


def pytest_unconfigure(config):
    run = _active(config)
    if run is not None:
        run.end()
        del config.stash[_RUN]


def pytest_sessionstart(session):
    run = _active(session.config)
    if run is None:
        return
    problems = selection.unmatched(run.kinds, run.plugins, OPTIONS)
    if problems:
        run.problems, run.exit_code = problems, runner.NOTHING_CHECKED
        run.write_report([])
        pytest.exit("\n".join(f"nothing checked: {problem}" for problem in problems),
                    returncode=runner.NOTHING_CHECKED)


def _suite_check_module(path: Path) -> bool:
    return path.parent == SUITE_DIR and path.name.startswith("check_") and path.suffix == ".py"


def pytest_ignore_collect(collection_path, config):
    run = _active(config)
    if run is not None and _suite_check_module(collection_path) and collection_path.stem not in run.modules:
        return True  # a check group of a kind this run did not ask for
    return None


def pytest_collect_file(file_path, parent):
    # The suite's modules are named check_*.py; collect them even where python_files
    # does not say so, and leave them to pytest's own collector where it does, or where
    # they were named on the command line (as the runner names them).
    if not _suite_check_module(file_path) or parent.session.isinitpath(file_path):
        return None
    if any(fnmatch.fnmatch(file_path.name, pattern) for pattern in parent.config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(config, items):
    run = _active(config)
    if run is None:
        return
    rank = {name: i for i, name in enumerate(run.modules)}  # check_modules' order: light groups first
    items.sort(key=lambda item: rank.get(item.path.stem, -1) if _suite_check_module(item.path) else -1)


def pytest_sessionfinish(session, exitstatus):
    run = _active(session.config)
    if run is not None:
        session.exitstatus = run.finish(int(exitstatus))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    run = _active(config)
    if run is None:
        return
    write = terminalreporter.write_line
    lines = runner.failure_lines(run.collector.sorted_results(), run.seed)
    if lines or run.problems:
        terminalreporter.section("kvforge conformance")
    for line in lines:
        write(f"FAIL {line}", red=True)
    for problem in run.problems:
        write(f"nothing checked: {problem}", red=True)
    write(f"seed {run.seed}: replay this run with --kvforge-seed {run.seed}")
    if run.report_path:
        write(f"report: {run.report_path}")
