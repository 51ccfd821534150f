"""Pytest hooks of the suite: parametrizes the `registration` fixture of every check
module over the selected implementations of the module's KIND, pins one seed for the
whole run, and fails any check that runs past its time limit."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import signal
import threading

import pytest

from kvforge.conformance.attention_cases import SEED_ENV
from kvforge.conformance.selection import TIME_LIMIT_ENV, selected, time_limit

_seed_set_here = False


class CheckTimedOut(BaseException):
    """Raised inside a check that ran past its time limit. A BaseException, so that
    neither a check's `except Exception` nor Hypothesis's shrinking catches it and
    runs the hanging code again."""


def pytest_configure(config):
    # One seed for every check of the run, so a lucky pass or a failure replays whole.
    global _seed_set_here
    if not os.environ.get(SEED_ENV):
        os.environ[SEED_ENV] = str(random.SystemRandom().randrange(2**31))
        _seed_set_here = True


def pytest_unconfigure(config):
    global _seed_set_here
    if _seed_set_here:
        os.environ.pop(SEED_ENV, None)
        _seed_set_here = False


def pytest_terminal_summary(terminalreporter):
    seed = os.environ.get(SEED_ENV)
    terminalreporter.write_line(f"kvforge conformance seed: {seed} (replay: {SEED_ENV}={seed})")


def pytest_generate_tests(metafunc):
    if "registration" in metafunc.fixturenames:
        kind = getattr(metafunc.module, "KIND")
        registrations = selected(kind)
        metafunc.parametrize("registration", registrations, ids=[r.name for r in registrations])


@contextlib.contextmanager
def limited(limit: float, what: str):
    """Fail `what` with CheckTimedOut after `limit` seconds (0: never). SIGALRM reaches
    a check only between Python bytecodes; for a hang inside native code, or off the
    main thread where no alarm can be set, a backstop ends the whole process at
    twice the limit with every thread's traceback rather than hang a CI job forever."""
    if limit <= 0:
        yield
        return
    alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if alarm:
        def expire(signum, frame):
            raise CheckTimedOut(f"{what} ran past its time limit of {limit:g} s: the implementation hangs or is far "
                                f"too slow (raise the limit with --time-limit or {TIME_LIMIT_ENV}; 0 turns it off)")
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(2 * limit + 10, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with limited(time_limit(), f"setting up {item.name}"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with limited(time_limit(), item.name):
        yield
