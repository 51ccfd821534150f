"""Which implementations the conformance suite runs against, under which seed and time limit.

The runner passes its choices through environment variables so that plain
`pytest --pyargs kvforge.conformance` and `kvforge conformance` select alike.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Sequence

from kvforge.core import KINDS, ConfigError, Registration, Registry, build_registry
from kvforge.core.registry import PLUGINS_ENV

PLUGIN_ENV = "KVFORGE_CONFORMANCE_PLUGINS"  # comma-separated implementation or entry-point names
QUICK_ENV = "KVFORGE_CONFORMANCE_QUICK"  # "1": the reduced grid
TIME_LIMIT_ENV = "KVFORGE_CONFORMANCE_TIME_LIMIT"  # seconds one check may take; 0: no limit
FAIL_FAST_ENV = "KVFORGE_CONFORMANCE_FAIL_FAST"  # "1": skip an implementation's checks after its first failure
DEVICE_ENV = "KVFORGE_CONFORMANCE_DEVICE"  # where attention backends run: "cpu", "cuda"; unset: cuda where present
DEFAULT_TIME_LIMIT_S = 120.0
DEVICES = ("cpu", "cuda")


def quick() -> bool:
    return os.environ.get(QUICK_ENV, "") == "1"


class QuickGrid(Sequence):
    """A check's parameter values: `full` normally, `quick` under --quick. Read when
    pytest collects (not when the module is imported), so the run's choice holds
    however early the module was imported; use it as `parametrize`'s argvalues."""

    def __init__(self, full, quick):
        self.full, self.quick = tuple(full), tuple(quick)

    def _values(self) -> tuple:
        return self.quick if quick() else self.full

    def __getitem__(self, index):
        return self._values()[index]

    def __len__(self) -> int:
        return len(self._values())

    def __repr__(self) -> str:
        return f"QuickGrid(full={list(self.full)}, quick={list(self.quick)})"


def fail_fast() -> bool:
    return os.environ.get(FAIL_FAST_ENV, "") == "1"


def time_limit() -> float:
    """Seconds one check (its setup, then its body) may run before it fails; 0 means no limit."""
    value = os.environ.get(TIME_LIMIT_ENV, "").strip()
    if not value:
        return DEFAULT_TIME_LIMIT_S
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not limit >= 0:
        raise ConfigError(f"{TIME_LIMIT_ENV}={value!r} (or --time-limit) is not a number of seconds >= 0 "
                         f"(default {DEFAULT_TIME_LIMIT_S:g}; 0 turns the limit off)")
    return limit


def device() -> str | None:
    """The device the run asked for, or None for the default (CUDA where present and declared, else CPU)."""
    return os.environ.get(DEVICE_ENV, "").strip() or None


def device_problem(name: str | None) -> str | None:
    """Why `name` cannot be the run's device, or None when it can: an unknown name,
    or CUDA asked for where torch sees no GPU. Said before any check runs, so a CI
    job on the wrong machine fails at once instead of skipping every backend."""
    if name is None or name == "cpu":
        return None
    if name not in DEVICES:
        return f"device {name!r} is not one of {', '.join(DEVICES)} (--device, or {DEVICE_ENV})"
    import torch

    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"device 'cuda' was asked for, but torch {torch.__version__} ({built}) sees no GPU here; "
                "run on a machine with one, or leave --device out to check on the CPU")
    return None


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    return build_registry()


def wanted_names() -> set[str]:
    return {name.strip() for name in os.environ.get(PLUGIN_ENV, "").split(",") if name.strip()}


def selected(kind: str) -> list[Registration]:
    """Registered implementations of `kind`, narrowed by `KVFORGE_CONFORMANCE_PLUGINS`
    (which matches an implementation name or the entry-point name of its plugin)."""
    wanted = wanted_names()
    return [r for r in registry().implementations(kind) if not wanted or r.name in wanted or r.plugin in wanted]


def unmatched(kinds: list[str] | None, plugins: list[str] | None, options: str = "--") -> list[str]:
    """Why a selection would check nothing, one message per name or kind: each `plugins`
    name that selects no implementation of the kinds run (with its load error, the
    duplicate that disabled it, the filter that skipped it, or a "did you mean"), and
    each kind asked for by name that is left with no implementation. `options` prefixes
    the option names the messages quote (`--kvforge-` for the pytest entry)."""
    reg, run = registry(), kinds or list(KINDS)
    problems = []
    for name in plugins or []:
        if any(r.kind in run and name in (r.name, r.plugin) for r in reg.implementations()):
            continue
        problems.append(f"{options}plugin {name!r} selects nothing: " + _why_nothing(reg, name, run, options))
    for kind in kinds or []:
        names = plugins or []
        found = [r for r in reg.implementations(kind) if not names or r.name in names or r.plugin in names]
        if found:
            continue
        registered = ", ".join(r.name for r in reg.implementations(kind))
        among = f"; registered: {registered}" if registered else "; none is registered (see `kvforge plugins`)"
        problems.append(f"{options}kind {kind} checks nothing: no {kind} implementation is selected{among}")
    return problems


def _why_nothing(reg: Registry, name: str, run: list[str], options: str) -> str:
    reasons = [f"plugin {e.plugin!r} ({e.distribution} {e.version}) failed at {e.stage}: {e.message}"
               for e in reg.errors if e.plugin == name]
    reasons += [f"{kind} {name!r} is disabled because "
                f"{' and '.join(f'plugin {h.plugin!r} ({h.distribution} {h.version})' for h in holders)} both register "
                f"it; deny one of them (plugins.deny or {PLUGINS_ENV}=-NAME) to check the other"
                for (kind, other), holders in reg.conflicts.items() if other == name and kind in run]
    if name in reg.skipped_plugins:
        reasons.append(f"plugin {name!r} is filtered out by {PLUGINS_ENV}={os.environ.get(PLUGINS_ENV, '')!r}")
    reasons += [f"{r.name!r} is a {r.kind}, and only {options}kind {f' {options}kind '.join(run)} runs"
                for r in reg.implementations() if name in (r.name, r.plugin) and r.kind not in run]
    if reasons:
        return "; ".join(dict.fromkeys(reasons))
    known = sorted({r.name for r in reg.implementations()} | {r.plugin for r in reg.implementations()}
                   | {e.plugin for e in reg.errors} | {n for _, n in reg.conflicts})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"no implementation or plugin has that name; {hint}`kvforge plugins` lists what is registered"
