"""The cyclic garbage collector in a process that builds one engine and then runs
until it exits: `kvforge generate`, `kvforge serve` and its replicas.

Start-up (torch, transformers, the engine) leaves a few hundred thousand objects
that live as long as the process. Each full collection walks all of them: a few
during start-up, one now and then while serving (a pause in every stream), and
several at exit, where most of the interpreter's teardown goes to them.
`long_lived_start_up` pauses the collector while the engine is built, then
collects once and freezes what is left (`gc.freeze`: later collections skip
it), as vLLM's engine core does after its start-up. A frozen object is still
freed when its last reference goes; only cycles among frozen objects are never
collected, so code that builds many engines in one process (tests, notebooks)
should not use it.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def long_lived_start_up():
    """Run the block (building the engine) with the cyclic collector paused; when it
    succeeds, collect once and freeze every object left (`gc.freeze`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.collect()
        gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
