"""Runs the check groups with pytest and folds the outcomes into a matrix:
implementation × check group → pass, fail, or skipped with the reason."""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvforge.core import KINDS, Registration

from . import selection


@dataclass
class GroupResult:
    kind: str
    implementation: str
    group: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    skip_reasons: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.failed:
            return "fail"
        if self.passed:
            return "pass"
        return "skipped"


def check_modules(kinds: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(module name, kind, group) of every check module, optionally for some kinds."""
    found = []
    package_dir = Path(__file__).parent
    for info in pkgutil.iter_modules([str(package_dir)]):
        if not info.name.startswith("check_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if kinds is None or module.KIND in kinds:
            found.append((info.name, module.KIND, module.GROUP))
    return sorted(found, key=lambda m: (KINDS.index(m[1]), m[2]))


class _Collector:
    def __init__(self, groups: dict[str, tuple[str, str]]):
        self.groups = groups  # module name -> (kind, group)
        self.results: dict[tuple[str, str], GroupResult] = {}
        self.implementation_of: dict[str, str] = {}  # node id -> implementation name

    def pytest_itemcollected(self, item):
        callspec = getattr(item, "callspec", None)
        registration = callspec.params.get("registration") if callspec is not None else None
        if isinstance(registration, Registration):  # an empty parameter set holds a sentinel
            self.implementation_of[item.nodeid] = registration.name

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and (report.skipped or report.failed)):
            return
        module = Path(report.location[0]).stem
        if module not in self.groups:
            return
        kind, group = self.groups[module]
        implementation = self.implementation_of.get(report.nodeid)
        if implementation is None:  # no implementation of this kind was selected
            return
        result = self.results.setdefault((implementation, group), GroupResult(kind, implementation, group))
        if report.passed:
            result.passed += 1
        elif report.skipped:
            result.skipped += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if reason not in result.skip_reasons:
                result.skip_reasons.append(reason)
        else:
            result.failed += 1
            # module::test[params]: the nodeid alone loses the module when run outside the rootdir
            result.failures.append(f"{module}::{report.location[2]}: {first_error_line(report.longreprtext)}")


def first_error_line(longrepr: str) -> str:
    """The first `E ` line of a failure (the assertion message or the exception),
    else its last line: the location line alone says only `Failed`."""
    lines = longrepr.strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return errors[0] if errors else (lines[-1] if lines else "")


def run_conformance(kinds: list[str] | None = None, plugins: list[str] | None = None, quick: bool = False,
                    pytest_args: list[str] | None = None) -> tuple[int, list[GroupResult]]:
    """Run every check group of `kinds` against the selected implementations.
    Returns pytest's exit code and one result per (implementation, group)."""
    modules = check_modules(kinds)
    if not modules:
        return 0, []
    os.environ[selection.PLUGIN_ENV] = ",".join(plugins or [])
    os.environ[selection.QUICK_ENV] = "1" if quick else ""
    selection.registry.cache_clear()
    collector = _Collector({name: (kind, group) for name, kind, group in modules})
    targets = [f"{__package__}.{name}" for name, _, _ in modules]
    args = ["--pyargs", *targets, "-q", "-p", "no:cacheprovider", "--no-header", "-rN", *(pytest_args or [])]
    code = pytest.main(args, plugins=[collector])
    results = sorted(collector.results.values(), key=lambda r: (KINDS.index(r.kind), r.implementation, r.group))
    return int(code), results
