"""Runs the check groups with pytest and folds the outcomes into a matrix:
implementation × check group → pass, fail, or skipped with the reason."""

from __future__ import annotations

import contextlib
import importlib
import linecache
import os
import pkgutil
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvforge.core import KINDS, Registration

from . import selection
from .applicability import is_not_applicable

NOTHING_CHECKED = int(pytest.ExitCode.NO_TESTS_COLLECTED)  # 5: a CI step that certified nothing must not pass
# pytest's own verbosity flags: when the caller passes one, the runner's default `-q` steps aside
_VERBOSITY_FLAGS = ("-v", "-q", "--verbose", "--quiet", "--verbosity")


def traceback_style(pytest_args: list[str]) -> list[str]:
    """How much of each failure pytest prints: the caller's `--tb` when given; full
    tracebacks under `-v`; otherwise pytest's short ones (the failing line and its
    message), because the run ends with one summary line per failure anyway."""
    if any(a.startswith("--tb") for a in pytest_args):
        return []
    verbose = any(a.startswith(("-v", "--verbose")) or (a.startswith("--verbosity") and not a.endswith("=0"))
                  for a in pytest_args)
    return ["--tb=long" if verbose else "--tb=short"]


@dataclass(frozen=True)
class Failure:
    """One failing check of one implementation: `check` is `module::test`, `case` its
    parameters (the implementation first), `message` the first line of what broke."""

    check: str
    case: str
    message: str


@dataclass
class GroupResult:
    kind: str
    implementation: str
    group: str
    plugin: str = ""
    distribution: str = ""
    version: str = ""
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    not_applicable: int = 0
    duration_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    skip_reasons: list[str] = field(default_factory=list)  # distinct, the "not applicable: ..." ones among them

    @property
    def status(self) -> str:
        """"fail" (a check failed), "pass" (one passed, none failed), "skipped" (none ran, and
        something kept a check from running: the implementation is unavailable here, ...), or
        "n/a" (none ran because none applies, as a static-scale group to a dynamic quantizer)."""
        if self.failed:
            return "fail"
        if self.passed:
            return "pass"
        if self.not_applicable and not self.skipped:
            return "n/a"
        return "skipped"


@dataclass
class ConformanceRun:
    """What one run did: pytest's exit code, one result per (implementation, group),
    the seed every check drew from, the per-check time limit, and when and how long."""

    code: int
    results: list[GroupResult]
    seed: int
    time_limit_s: float
    quick: bool
    started: float
    duration_s: float


def check_modules(kinds: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(module name, kind, group) of every check module, optionally for some kinds, in the
    order they run: by kind, a kind's light groups before those marked `HEAVY = True`."""
    found = []
    package_dir = Path(__file__).parent
    for info in pkgutil.iter_modules([str(package_dir)]):
        if not info.name.startswith("check_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if kinds is None or module.KIND in kinds:
            found.append((getattr(module, "HEAVY", False), info.name, module.KIND, module.GROUP))
    found.sort(key=lambda m: (KINDS.index(m[2]), m[0], m[3]))
    return [(name, kind, group) for _, name, kind, group in found]


def selected_check_modules(kinds: list[str] | None = None) -> list[tuple[str, str, str]]:
    """`check_modules(kinds)` less the groups of kinds with no selected implementation,
    whose checks would only be collected to be skipped for an empty parameter set."""
    return [module for module in check_modules(kinds) if selection.selected(module[1])]


class Collector:
    """A pytest plugin that folds each check's outcome into its (implementation, group)
    result: the runner's, and the pytest entry's (`--kvforge-plugin`) alike."""

    def __init__(self, groups: dict[str, tuple[str, str]]):
        self.groups = groups  # module name -> (kind, group)
        self.results: dict[tuple[str, str], GroupResult] = {}
        self.registration_of: dict[str, Registration] = {}  # node id -> implementation
        self.case_of: dict[str, str] = {}  # node id -> parameter id
        self.error_of: dict[tuple[str, str], str] = {}  # (node id, phase) -> what broke

    def sorted_results(self) -> list[GroupResult]:
        return sorted(self.results.values(), key=lambda r: (KINDS.index(r.kind), r.implementation, r.group))

    def pytest_itemcollected(self, item):
        callspec = getattr(item, "callspec", None)
        registration = callspec.params.get("registration") if callspec is not None else None
        if isinstance(registration, Registration):  # an empty parameter set holds a sentinel
            self.registration_of[item.nodeid] = registration
            self.case_of[item.nodeid] = callspec.id

    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and item.nodeid in self.registration_of:
            self.error_of[(item.nodeid, call.when)] = describe_error(call.excinfo)

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown" and not report.failed:
            return
        module = Path(report.location[0]).stem
        registration = self.registration_of.get(report.nodeid)
        if module not in self.groups or registration is None:  # or no implementation of this kind was selected
            return
        kind, group = self.groups[module]
        result = self.results.setdefault((registration.name, group), GroupResult(
            kind, registration.name, group, registration.plugin, registration.distribution, registration.version))
        result.duration_s += report.duration
        if report.when == "call" and report.passed:
            result.passed += 1
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if is_not_applicable(reason):
                result.not_applicable += 1
            else:
                result.skipped += 1
            if reason not in result.skip_reasons:
                result.skip_reasons.append(reason)
        elif report.failed:
            message = self.error_of.get((report.nodeid, report.when)) or first_error_line(report.longreprtext)
            test = report.location[2].split("[", 1)[0]
            failure = Failure(f"{module}::{test}", self.case_of[report.nodeid],
                              message if report.when == "call" else f"({report.when}) {message}")
            if failure not in result.failures:  # a failed call then a failed teardown say one thing twice
                result.failed += 1
                result.failures.append(failure)


def describe_error(excinfo) -> str:
    """One line for what broke: the exception's first message line; for a bare
    exception, the source line that raised it; for a group (Hypothesis reporting
    several distinct failures), each member's line."""
    exc = excinfo.value
    members = getattr(exc, "exceptions", None)  # an exception group's (Python 3.11+)
    if isinstance(members, tuple) and members:
        return f"{len(members)} distinct failures: " + " | ".join(_one_line(m, None) for m in members)
    return _one_line(exc, excinfo)


def _one_line(exc: BaseException, excinfo) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines:
        return f"{type(exc).__name__}: {lines[0]}"
    where = ""
    traceback = exc.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    if traceback is not None:
        frame = traceback.tb_frame
        source = linecache.getline(frame.f_code.co_filename, traceback.tb_lineno).strip()
        where = f" at {Path(frame.f_code.co_filename).name}:{traceback.tb_lineno}" + (f" ({source})" if source else "")
    return f"{type(exc).__name__}{where}"


def first_error_line(longrepr: str) -> str:
    """The first `E ` line of a failure (the assertion message or the exception),
    else its last line: the location line alone says only `Failed`."""
    lines = longrepr.strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return errors[0] if errors else (lines[-1] if lines else "")


def run_seed(seed: int | None = None) -> int:
    """The seed of a run: `seed`, else the one pinned in the environment, else a fresh one."""
    from .attention_cases import SEED_ENV

    if seed is not None:
        return seed
    pinned = os.environ.get(SEED_ENV, "").strip()
    return int(pinned) if pinned else random.SystemRandom().randrange(2**31)


def run_conformance(kinds: list[str] | None = None, plugins: list[str] | None = None, quick: bool = False,
                    pytest_args: list[str] | None = None, seed: int | None = None,
                    time_limit_s: float | None = None, device: str | None = None,
                    fail_fast: bool = False) -> ConformanceRun:
    """Run every check group of `kinds` against the selected implementations, every
    check drawing from one `seed` (fresh when None), failing past `time_limit_s`
    seconds (None: the environment's or the default), attention backends on `device`
    (None: CUDA where present); `fail_fast` skips an implementation's checks after its
    first failure. Returns what the run did."""
    started = time.time()
    seed = run_seed(seed)
    with run_environment(plugins, quick, seed, time_limit_s, device, fail_fast):
        limit = selection.time_limit()
        selection.registry.cache_clear()
        modules = selected_check_modules(kinds)
        if not modules:
            return ConformanceRun(0, [], seed, limit, quick, started, 0.0)
        code, results = _run_pytest(modules, pytest_args)
    return ConformanceRun(code, results, seed, limit, quick, started, time.time() - started)


@contextlib.contextmanager
def run_environment(plugins: list[str] | None, quick: bool, seed: int, time_limit_s: float | None = None,
                    device: str | None = None, fail_fast: bool = False):
    """The checks read a run's choices from the environment, so that `kvforge conformance`,
    the pytest options (`--kvforge-plugin` ...) and plain pytest select alike; set them
    for one run only, so a later run in this process starts clean."""
    from .attention_cases import SEED_ENV

    values = {SEED_ENV: str(seed), selection.PLUGIN_ENV: ",".join(plugins or []),
              selection.QUICK_ENV: "1" if quick else "", selection.FAIL_FAST_ENV: "1" if fail_fast else ""}
    if time_limit_s is not None:
        values[selection.TIME_LIMIT_ENV] = f"{time_limit_s:g}"
    if device is not None:
        values[selection.DEVICE_ENV] = device
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def unchecked(results: list[GroupResult], plugins: list[str] | None, options: str = "--") -> list[str]:
    """What the run was asked to check but did not: everything, or a named implementation
    whose every check was skipped (an unavailable backend certifies nothing). `options`
    as in `selection.unmatched`."""
    if not any(r.passed or r.failed for r in results):
        return ["no check ran: every selected check was skipped or deselected" if results
                else "no check ran: no selected implementation has a check of the selected kinds"]
    problems = []
    for name in plugins or []:
        mine = [r for r in results if name in (r.implementation, r.plugin)]
        if mine and not any(r.passed or r.failed for r in mine):
            reasons = "; ".join(dict.fromkeys(reason for r in mine for reason in r.skip_reasons))
            problems.append(f"{options}plugin {name!r}: every check was skipped ({reasons})")
    return problems


def failure_lines(results: list[GroupResult], seed: int) -> list[str]:
    """One line per failing check, `implementation module::test[case] seed=N: what broke`,
    the line a CI log shows and a developer greps for."""
    return [f"{r.implementation} {f.check}[{f.case}] seed={seed}: {f.message}" for r in results for f in r.failures]


def _run_pytest(modules: list[tuple[str, str, str]], pytest_args: list[str] | None) -> tuple[int, list[GroupResult]]:
    collector = Collector({name: (kind, group) for name, kind, group in modules})
    targets = [f"{__package__}.{name}" for name, _, _ in modules]
    extra = list(pytest_args or [])
    verbosity = [] if any(a.startswith(_VERBOSITY_FLAGS) for a in extra) else ["-q"]
    # rootdir = this package, so node ids (failures, --collect-only) name the module wherever the run starts
    args = ["--pyargs", *targets, *verbosity, *traceback_style(extra), "-p", "no:cacheprovider", "--no-header", "-rN",
            "-W", "ignore::pytest.PytestAssertRewriteWarning",  # the suite's own package, imported to find the groups
            "--rootdir", str(Path(__file__).parent), *extra]
    code = pytest.main(args, plugins=[collector])
    return int(code), collector.sorted_results()
