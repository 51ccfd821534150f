"""The registry: discovers plugins through entry points and selects implementations.

Built-in implementations arrive through the very same entry points as
third-party ones (declared in kvforge's `pyproject.toml`).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from .api import API_VERSION, ENTRY_POINT_GROUP, KINDS
from .errors import ApiVersionError, DuplicateImplementationError, PluginError, SelectionError
from .hookspecs import PROJECT_NAME, KvforgeHookSpec
from .implementation import Availability, Implementation, SelectionRequest

log = logging.getLogger("kvforge.plugins")

AUTO = "auto"
PLUGINS_ENV = "KVFORGE_PLUGINS"


@dataclass(frozen=True)
class Registration:
    """One implementation as the registry knows it."""

    kind: str
    name: str
    cls: type[Implementation]
    plugin: str  # entry-point name
    distribution: str
    version: str
    api_version: tuple[int, int]

    def availability(self) -> Availability:
        try:
            return self.cls.availability()
        except Exception as exc:  # a plugin's bug must not take the host down
            return Availability.no(f"availability() raised {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class LoadError:
    """A plugin, or one implementation of it, that could not be registered."""

    plugin: str
    distribution: str
    version: str
    stage: str  # "import", "register", "api_version", "duplicate", "invalid"
    message: str


@dataclass(frozen=True)
class Candidate:
    """One implementation judged for a selection: why it was or was not chosen."""

    registration: Registration
    availability: Availability
    reasons: tuple[str, ...]

    @property
    def usable(self) -> bool:
        return self.availability.ok and not self.reasons

    def why_not(self) -> str:
        if not self.availability.ok:
            return f"unavailable: {self.availability.reason}"
        return "; ".join(self.reasons)


@dataclass
class PluginFilter:
    """Allow and deny lists of entry-point names. `allow=None` allows everything."""

    allow: frozenset[str] | None = None
    deny: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, value: str | None) -> "PluginFilter":
        """Parse `KVFORGE_PLUGINS`: comma-separated names to allow, `-name` to deny."""
        allow, deny = set(), set()
        for item in (value or "").split(","):
            item = item.strip()
            if item.startswith("-"):
                deny.add(item[1:].strip())
            elif item:
                allow.add(item)
        return cls(frozenset(allow) if allow else None, frozenset(deny))

    def admits(self, plugin: str) -> bool:
        return plugin not in self.deny and (self.allow is None or plugin in self.allow)


class Registry:
    """Every registered implementation, keyed by (kind, name), and every load error."""

    def __init__(self, *, filters: Iterable[PluginFilter] = (), strict: bool = False):
        self.filters = list(filters)
        self.strict = strict
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(KvforgeHookSpec)
        self.registrations: dict[tuple[str, str], Registration] = {}
        self.conflicts: dict[tuple[str, str], list[str]] = {}
        self.errors: list[LoadError] = []
        self.skipped_plugins: list[str] = []

    # Loading

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> "Registry":
        """Load every `kvforge.plugins` entry point the filters admit."""
        if entry_points is None:
            entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for entry_point in sorted(entry_points, key=lambda ep: ep.name):
            dist = getattr(entry_point, "dist", None)
            distribution = dist.name if dist is not None else "(unknown)"
            version = dist.version if dist is not None else "(unknown)"
            if not all(f.admits(entry_point.name) for f in self.filters):
                self.skipped_plugins.append(entry_point.name)
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:
                self._record(LoadError(entry_point.name, distribution, version, "import", f"{type(exc).__name__}: {exc}"))
                continue
            self.register_plugin(plugin, entry_point.name, distribution, version)
        return self

    def register_plugin(self, plugin: Any, name: str, distribution: str = "(local)", version: str = "") -> None:
        """Register an already-imported plugin object (a module or any object with hooks)."""
        try:
            self.plugin_manager.register(plugin, name=name)
            self.plugin_manager.check_pending()
            hookimpls = [
                impl for impl in self.plugin_manager.hook.kvforge_implementations.get_hookimpls() if impl.plugin is plugin
            ]
            if not hookimpls:
                raise PluginError("it implements no kvforge_implementations hook")
            classes = [cls for impl in hookimpls for cls in (impl.function() or [])]
        except Exception as exc:
            if self.plugin_manager.is_registered(plugin):
                self.plugin_manager.unregister(plugin)
            self._record(LoadError(name, distribution, version, "register", f"{type(exc).__name__}: {exc}"))
            return
        for cls in classes:
            self._add(cls, name, distribution, version)

    def _add(self, cls: Any, plugin: str, distribution: str, version: str) -> None:
        where = f"plugin {plugin!r} ({distribution} {version})"
        if not (isinstance(cls, type) and issubclass(cls, Implementation)) or getattr(cls, "kind", None) not in KINDS:
            self._record(LoadError(plugin, distribution, version, "invalid",
                                   f"{where} returned {cls!r}, which subclasses none of the interfaces {list(KINDS)}"))
            return
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
            self._record(LoadError(plugin, distribution, version, "invalid", f"{where}: {cls.__qualname__} sets no `name`"))
            return
        wanted = tuple(cls.api_version)
        if wanted[0] != API_VERSION[0] or wanted[1] > API_VERSION[1]:
            self._record(LoadError(plugin, distribution, version, "api_version",
                f"{where}: {cls.kind} {cls.name!r} was written for kvforge API {wanted[0]}.{wanted[1]}, but this "
                f"kvforge offers API {API_VERSION[0]}.{API_VERSION[1]}; install a version of {distribution} "
                f"built for API {API_VERSION[0]}.x"), ApiVersionError)
            return
        key = (cls.kind, cls.name)
        registration = Registration(cls.kind, cls.name, cls, plugin, distribution, version, wanted)
        if key in self.registrations or key in self.conflicts:
            first = self.registrations.pop(key, None)
            holders = self.conflicts.setdefault(key, [f"{first.distribution} (plugin {first.plugin!r})"] if first else [])
            holders.append(f"{distribution} (plugin {plugin!r})")
            self._record(LoadError(plugin, distribution, version, "duplicate",
                f"{cls.kind} {cls.name!r} is registered by both {' and '.join(holders)}; deny one of these plugins "
                f"(plugins.deny or {PLUGINS_ENV}=-NAME) to choose"), DuplicateImplementationError)
            return
        self.registrations[key] = registration

    def _record(self, error: LoadError, exc_type: type[PluginError] = PluginError) -> None:
        self.errors.append(error)
        message = f"kvforge plugin {error.plugin!r} ({error.distribution} {error.version}) failed at {error.stage}: {error.message}"
        if self.strict:
            raise exc_type(message + " (plugins.strict is on)")
        log.warning(message)

    # Queries

    def implementations(self, kind: str | None = None) -> list[Registration]:
        found = [r for r in self.registrations.values() if kind is None or r.kind == kind]
        return sorted(found, key=lambda r: (KINDS.index(r.kind), -r.cls.priority, r.name))

    def names(self, kind: str) -> list[str]:
        return sorted({r.name for r in self.implementations(kind)} | {n for k, n in self.conflicts if k == kind})

    def get(self, kind: str, name: str) -> Registration:
        """The registration of `name`, or an error listing the valid names."""
        if kind not in KINDS:
            raise SelectionError(f"unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        if (kind, name) in self.conflicts:
            raise DuplicateImplementationError(
                f"{kind} {name!r} is registered by {' and '.join(self.conflicts[(kind, name)])}; "
                f"deny one of these plugins (plugins.deny or {PLUGINS_ENV}=-NAME) to choose")
        registration = self.registrations.get((kind, name))
        if registration is None:
            raise SelectionError(unknown_name_message(kind, name, self.names(kind)))
        return registration

    def candidates(self, kind: str, request: SelectionRequest | None = None) -> list[Candidate]:
        """Every implementation of `kind`, best first, judged against `request`."""
        request = request or SelectionRequest()
        judged = []
        for registration in self.implementations(kind):
            try:
                reasons = tuple(registration.cls.unsupported_reasons(request))
            except Exception as exc:
                reasons = (f"unsupported_reasons() raised {type(exc).__name__}: {exc}",)
            judged.append(Candidate(registration, registration.availability(), reasons))
        return judged

    def select(self, kind: str, name: str, request: SelectionRequest | None = None) -> Registration:
        """Resolve `name` (or `auto`) for `request`; never a silent fallback."""
        request = request or SelectionRequest()
        if name != AUTO:
            registration = self.get(kind, name)
            candidate = next(c for c in self.candidates(kind, request) if c.registration is registration)
            if not candidate.usable:
                raise SelectionError(f"{kind} {name!r} cannot serve this configuration: {candidate.why_not()}")
            return registration
        candidates = self.candidates(kind, request)
        chosen = next((c for c in candidates if c.usable), None)
        if chosen is None:
            details = "; ".join(f"{c.registration.name}: {c.why_not()}" for c in candidates) or "none registered"
            raise SelectionError(f"no {kind} can serve this configuration ({details})")
        skipped = ", ".join(f"{c.registration.name} ({c.why_not() or 'lower priority'})"
                            for c in candidates if c is not chosen)
        log.info("auto chose %s %r%s", kind, chosen.registration.name, f"; skipped {skipped}" if skipped else "")
        return chosen.registration


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    message = f"unknown {kind} {name!r}; valid choices: {', '.join([AUTO, *valid]) if valid else AUTO + ' (none registered)'}"
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message


def build_registry(allow: Iterable[str] | None = None, deny: Iterable[str] = (), strict: bool = False,
                   environ: dict[str, str] | None = None) -> Registry:
    """A registry loaded from the installed entry points, filtered by the config's
    allow/deny lists and by `KVFORGE_PLUGINS`; a plugin must pass both."""
    environ = os.environ if environ is None else environ
    filters = [
        PluginFilter(frozenset(allow) if allow is not None else None, frozenset(deny)),
        PluginFilter.from_env(environ.get(PLUGINS_ENV)),
    ]
    return Registry(filters=filters, strict=strict).load_entry_points()
