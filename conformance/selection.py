"""Which implementations the conformance suite runs against.

The runner passes its choices through environment variables so that plain
`pytest --pyargs kvforge.conformance` and `kvforge conformance` select alike.
"""

from __future__ import annotations

import functools
import os

from kvforge.core import Registration, Registry, build_registry

PLUGIN_ENV = "KVFORGE_CONFORMANCE_PLUGINS"  # comma-separated implementation or entry-point names
QUICK_ENV = "KVFORGE_CONFORMANCE_QUICK"  # "1": the reduced grid


def quick() -> bool:
    return os.environ.get(QUICK_ENV, "") == "1"


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    return build_registry()


def selected(kind: str) -> list[Registration]:
    """Registered implementations of `kind`, narrowed by `KVFORGE_CONFORMANCE_PLUGINS`
    (which matches an implementation name or the entry-point name of its plugin)."""
    wanted = {name.strip() for name in os.environ.get(PLUGIN_ENV, "").split(",") if name.strip()}
    return [r for r in registry().implementations(kind) if not wanted or r.name in wanted or r.plugin in wanted]
