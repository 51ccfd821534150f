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
        if not self.availability.ok:  # the configuration's reasons too: installing it alone would not do
            also = f"; where it is available it would refuse: {'; '.join(self.reasons)}" if self.reasons else ""
            return f"unavailable: {self.availability.reason}{also}"
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

    def __init__(self, *, filters: Iterable[PluginFilter] = (), strict: bool = False, log_errors: bool = True):
        """`strict`: a load error raises (one error listing every load error of the
        call) instead of being recorded. `log_errors=False`: record load errors without
        logging them, for a caller that shows `errors` itself (`kvforge plugins`)."""
        self.filters = list(filters)
        self.strict = strict
        self.log_errors = log_errors
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(KvforgeHookSpec)
        self.registrations: dict[tuple[str, str], Registration] = {}
        self.conflicts: dict[tuple[str, str], list[Registration]] = {}
        self.errors: list[LoadError] = []
        self.skipped_plugins: list[str] = []
        self._conflict_errors: dict[tuple[str, str], list[LoadError]] = {}

    # Loading

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> "Registry":
        """Load every `kvforge.plugins` entry point the filters admit; then log each
        new load error once or, in strict mode, raise one error listing all of them."""
        known = set(self.errors)
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
                self.errors.append(LoadError(entry_point.name, distribution, version, "import", f"{type(exc).__name__}: {exc}"))
                continue
            self._register(plugin, entry_point.name, distribution, version)
        self._report(known)
        return self

    def register_plugin(self, plugin: Any, name: str, distribution: str = "(local)", version: str = "") -> None:
        """Register an already-imported plugin object (a module or any object with hooks);
        its load errors are logged or, in strict mode, raised as in `load_entry_points`."""
        known = set(self.errors)
        self._register(plugin, name, distribution, version)
        self._report(known)

    def _register(self, plugin: Any, name: str, distribution: str, version: str) -> None:
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
            self.errors.append(LoadError(name, distribution, version, "register", f"{type(exc).__name__}: {exc}"))
            return
        for cls in classes:
            self._add(cls, name, distribution, version)

    def _add(self, cls: Any, plugin: str, distribution: str, version: str) -> None:
        where = f"plugin {plugin!r} ({distribution} {version})"
        if not (isinstance(cls, type) and issubclass(cls, Implementation)) or getattr(cls, "kind", None) not in KINDS:
            self.errors.append(LoadError(plugin, distribution, version, "invalid",
                                         f"{where} returned {cls!r}, which subclasses none of the interfaces {list(KINDS)}"))
            return
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
            self.errors.append(LoadError(plugin, distribution, version, "invalid", f"{where}: {cls.__qualname__} sets no `name`"))
            return
        wanted = tuple(cls.api_version)
        if wanted[0] != API_VERSION[0] or wanted[1] > API_VERSION[1]:
            self.errors.append(LoadError(plugin, distribution, version, "api_version",
                                         api_version_message(where, cls.kind, cls.name, wanted, distribution)))
            return
        key = (cls.kind, cls.name)
        registration = Registration(cls.kind, cls.name, cls, plugin, distribution, version, wanted)
        if key in self.registrations or key in self.conflicts:
            holders = self.conflicts.setdefault(key, [self.registrations.pop(key)] if key in self.registrations else [])
            holders.append(registration)
            self._record_conflict(key)
            return
        self.registrations[key] = registration

    def _record_conflict(self, key: tuple[str, str]) -> None:
        """One `duplicate` error per plugin holding `key`, each naming every holder:
        none of them is registered, so each plugin's own errors must say why."""
        for stale in self._conflict_errors.pop(key, []):
            self.errors.remove(stale)
        holders = self.conflicts[key]
        message = duplicate_message(key, holders)
        fresh = [LoadError(h.plugin, h.distribution, h.version, "duplicate", message)
                 for h in {h.plugin: h for h in holders}.values()]
        self._conflict_errors[key] = fresh
        self.errors.extend(fresh)

    def _report(self, known: set[LoadError]) -> None:
        new = [error for error in self.errors if error not in known]
        if new and self.strict:
            raise strict_error(new)
        if self.log_errors:
            for error in new:
                log.warning(describe_load_error(error))

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
            raise DuplicateImplementationError(duplicate_message((kind, name), self.conflicts[(kind, name)]))
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

    def select(self, kind: str, name: str, request: SelectionRequest | None = None, *,
               prepare: bool = False) -> Registration:
        """Resolve `name` (or `auto`) for `request`; never a silent fallback.

        With `prepare`, the chosen implementation's `prepare()` runs before it is
        returned: a named one's failure is raised; under `auto` it is logged as a
        warning with its reason and the next usable implementation is tried."""
        request = request or SelectionRequest()
        if name != AUTO:
            registration = self.get(kind, name)
            candidate = next(c for c in self.candidates(kind, request) if c.registration is registration)
            if not candidate.usable:
                raise SelectionError(f"{kind} {name!r} cannot serve this configuration: {candidate.why_not()}")
            if prepare:
                registration.cls.prepare()
            return registration
        candidates = self.candidates(kind, request)
        failed: dict[str, str] = {}  # name -> why its prepare() failed
        for chosen in (c for c in candidates if c.usable):
            if prepare:
                try:
                    chosen.registration.cls.prepare()
                except Exception as exc:  # a plugin's set-up must not take the host down under auto
                    failed[chosen.registration.name] = f"prepare() failed: {type(exc).__name__}: {exc}"
                    log.warning("auto skipped %s %r: %s; trying the next one", kind, chosen.registration.name,
                                failed[chosen.registration.name])
                    continue
            skipped = ", ".join(f"{c.registration.name} ({failed.get(c.registration.name) or c.why_not() or 'lower priority'})"
                                for c in candidates if c is not chosen)
            log.info("auto chose %s %r%s", kind, chosen.registration.name, f"; skipped {skipped}" if skipped else "")
            return chosen.registration
        details = "; ".join(f"{c.registration.name}: {failed.get(c.registration.name) or c.why_not()}"
                            for c in candidates) or "none registered"
        raise SelectionError(f"no {kind} can serve this configuration ({details})")


def describe_load_error(error: LoadError) -> str:
    return f"kvforge plugin {error.plugin!r} ({error.distribution} {error.version}) failed at {error.stage}: {error.message}"


def api_version_message(where: str, kind: str, name: str, wanted: tuple[int, int], distribution: str) -> str:
    """Another major needs another build of the plugin; a newer minor of the same
    major needs a newer kvforge, since minors only add to the contract."""
    host = f"{API_VERSION[0]}.{API_VERSION[1]}"
    needs = f"{wanted[0]}.{wanted[1]}"
    if wanted[0] != API_VERSION[0]:
        return (f"{where}: {kind} {name!r} was written for kvforge API {needs}, but this kvforge offers API {host}; "
                f"install a version of {distribution} built for API {API_VERSION[0]}.x")
    return (f"{where}: {kind} {name!r} needs kvforge API {needs}, but this kvforge offers API {host}; "
            f"upgrade kvforge to a version offering API {needs} or later (pip install --upgrade kvforge)")


def duplicate_message(key: tuple[str, str], holders: list[Registration]) -> str:
    kind, name = key
    named = " and ".join(f"plugin {h.plugin!r} ({h.distribution} {h.version})" for h in holders)
    both = "both " if len(holders) == 2 else ""
    return (f"{kind} {name!r} is registered by {both}{named}, so none of them is selectable; deny one of these plugins "
            f"(plugins.deny or {PLUGINS_ENV}=-NAME) to choose")


_STAGE_ERRORS: dict[str, type[PluginError]] = {"api_version": ApiVersionError, "duplicate": DuplicateImplementationError}


def strict_error(errors: list[LoadError]) -> PluginError:
    """One error for every load error at once, so a strict run shows all there is
    to fix; its type is the stages' common one (`PluginError` when they differ)."""
    types = {_STAGE_ERRORS.get(e.stage, PluginError) for e in errors}
    exc_type = types.pop() if len(types) == 1 else PluginError
    count = f"{len(errors)} kvforge plugin load error{'s' if len(errors) > 1 else ''}"
    lines = "\n".join(f"  - {describe_load_error(e)}" for e in errors)
    return exc_type(f"{count} (plugins.strict is on):\n{lines}\nfix or uninstall these plugins, deny them "
                    f"(plugins.deny or {PLUGINS_ENV}=-NAME), or set plugins.strict=false to load the rest")


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    message = f"unknown {kind} {name!r}; valid choices: {', '.join([AUTO, *valid]) if valid else AUTO + ' (none registered)'}"
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message


def build_registry(allow: Iterable[str] | None = None, deny: Iterable[str] = (), strict: bool = False,
                   environ: dict[str, str] | None = None, log_errors: bool = True) -> Registry:
    """A registry loaded from the installed entry points, filtered by the config's
    allow/deny lists and by `KVFORGE_PLUGINS`; a plugin must pass both. `strict` and
    `log_errors` as in `Registry`."""
    environ = os.environ if environ is None else environ
    filters = [
        PluginFilter(frozenset(allow) if allow is not None else None, frozenset(deny)),
        PluginFilter.from_env(environ.get(PLUGINS_ENV)),
    ]
    return Registry(filters=filters, strict=strict, log_errors=log_errors).load_entry_points()
