"""How a child process ended, in the words of the errors that name it (a
distributed worker, a serving replica): one description for every such error."""

from __future__ import annotations

import signal


def describe_exit(pid: int | None, exitcode: int | None) -> str:
    """`(pid 42) was killed by signal 9 (SIGKILL)`, `(pid 42) exited with code 1`,
    or, for a process that closed its end of a pipe or socket but has not ended,
    `(pid 42) stopped answering but is still running`. `exitcode` is
    `multiprocessing.Process.exitcode`: negative for a signal, None while running."""
    who = f"(pid {pid}) " if pid is not None else ""
    if exitcode is None:
        return f"{who}stopped answering but is still running"
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:  # a real-time or otherwise unnamed signal
            name = ""
        return f"{who}was killed by signal {-exitcode}{name}"
    return f"{who}exited with code {exitcode}"
