"""The pluggy hook a plugin implements. This docstring is the spec plugin authors read.

A plugin is whatever its `kvforge.plugins` entry point loads: usually a module.
It implements the hook with the `hookimpl` marker:

    from kvforge.core import hookimpl

    @hookimpl
    def kvforge_implementations():
        return [MyBackend]
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvforge"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class KvforgeHookSpec:
    @hookspec
    def kvforge_implementations(self) -> list[type]:
        """Called once, when the registry loads the plugin.

        Return the implementation classes the plugin provides. Each must subclass
        one of the six interfaces in `kvforge.core`, set a `name` unique within
        its kind, and set `api_version` to the (major, minor) it was written for.
        The call must be cheap and must not require optional libraries: defer
        heavy imports to `availability()` or to construction. If it raises, the
        plugin is recorded as failed and the host carries on.
        """
