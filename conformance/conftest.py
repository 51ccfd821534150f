"""Pytest hooks of the suite: parametrizes the `registration` fixture of every check
module over the selected implementations of the module's KIND, pins one seed for the
whole run, fails any check that runs past its time limit, and under --fail-fast skips
an implementation's checks after its first failure."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import signal
import sys
import threading

import pytest

from kvforge.conformance.attention_cases import SEED_ENV
from kvforge.conformance.selection import TIME_LIMIT_ENV, fail_fast, selected, time_limit

TIMED_OUT = "ran past its time limit"  # in the message of every check the limit stopped or kept from running
_seed_set_here = False
_backstop_file = None  # where the backstop writes: the real stderr, not pytest's capture of it
# implementation name -> its first check that ran past the limit: the rest of its checks
# fail at once, so a hanging implementation costs one time limit, not one per check
_timed_out: dict[str, str] = {}
_failed: dict[str, str] = {}  # implementation name -> its first failing check, kept under --fail-fast


class CheckTimedOut(BaseException):
    """Raised inside a check that ran past its time limit. A BaseException, so that
    neither a check's `except Exception` nor Hypothesis's shrinking catches it and
    runs the hanging code again."""


def pytest_configure(config):
    global _seed_set_here, _backstop_file
    try:  # pytest's faulthandler plugin keeps a copy of the real stderr, made before capturing began
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        _backstop_file = config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):  # that plugin is off: stderr as Python started with it
        _backstop_file = sys.__stderr__
    # One seed for every check of the run, so a lucky pass or a failure replays whole.
    if not os.environ.get(SEED_ENV):
        os.environ[SEED_ENV] = str(random.SystemRandom().randrange(2**31))
        _seed_set_here = True


def pytest_unconfigure(config):
    global _seed_set_here
    _timed_out.clear()
    _failed.clear()
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
            raise CheckTimedOut(f"{what} {TIMED_OUT} of {limit:g} s: the implementation hangs or is far "
                                f"too slow (raise the limit with --time-limit or {TIME_LIMIT_ENV}; 0 turns it off)")
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(2 * limit + 10, exit=True, file=_backstop_file or sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _implementation(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    registration = callspec.params.get("registration") if callspec is not None else None
    return getattr(registration, "name", None)


@pytest.fixture(autouse=True)
def _not_after_a_timeout(request):
    name = _implementation(request.node)
    if name in _timed_out:
        pytest.fail(f"not run: {_timed_out[name]} of {name} {TIMED_OUT}, so {name}'s "
                    "remaining checks fail without running", pytrace=False)
    if name in _failed:
        pytest.skip(f"not run: {name} failed {_failed[name]} (--fail-fast)")


def _limited_phase(item, what: str):
    name = _implementation(item)
    with limited(time_limit(), what):
        outcome = yield
    error = outcome.excinfo[1] if outcome.excinfo else None
    if name is None or error is None or isinstance(error, pytest.skip.Exception):
        return
    if isinstance(error, CheckTimedOut):
        _timed_out.setdefault(name, item.name)
    elif fail_fast():
        _failed.setdefault(name, item.originalname)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _limited_phase(item, f"setting up {item.name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _limited_phase(item, item.name)
