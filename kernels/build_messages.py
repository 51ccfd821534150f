"""What a kernel build tells the person waiting for it: what is built, where and
for how long while it runs (`BuildProgress`), which command failed and how
(`failure_summary`) when it does not.

Everything goes to stderr: stdout belongs to the program (generated text, JSON).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

ESTIMATE = "about 1-2 minutes on 2 CPU cores, less with more"
TICK_S = 1.0  # how often a terminal's spinner line shows the elapsed seconds
LOG_EVERY_S = 15.0  # how often a plain "still building" line is written when stderr is no terminal
ERROR_LINES = 8  # compiler lines quoted from a failed command
# Arguments of torch's compile and link commands that say nothing about why one failed.
NOISE_WITH_VALUE = {"-MF", "-isystem", "-o", "-L"}
NOISE_PREFIXES = ("-MMD", "-D", "-I", "-L", "-l", "-Wl,")


class BuildProgress:
    """Announce a build on `stream` (default: stderr), then show that it is still
    running until the `with` block ends: a spinner with the elapsed seconds on a
    terminal, a line every `LOG_EVERY_S` seconds otherwise, and the total at the end."""

    def __init__(self, announcement: str, stream: TextIO | None = None, log_every_s: float = LOG_EVERY_S):
        self.announcement = announcement
        self.stream = stream if stream is not None else sys.stderr
        self.log_every_s = log_every_s
        self.elapsed_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status = None
        self._start = 0.0

    def __enter__(self) -> "BuildProgress":
        self._start = time.monotonic()
        self._write(f"kvforge: {self.announcement}")
        if _is_terminal(self.stream):
            from rich.console import Console

            self._status = Console(file=self.stream).status(self._spinner_text())
            self._status.start()
        self._thread = threading.Thread(target=self._tick, name="kvforge-build-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if self._status is not None:
            self._status.stop()
        self.elapsed_s = time.monotonic() - self._start
        outcome = "done" if exc_type is None else "failed"
        self._write(f"kvforge: C++ kernel build {outcome} after {self.elapsed_s:.0f} s")

    def _seconds(self) -> int:
        return round(time.monotonic() - self._start)

    def _spinner_text(self) -> str:
        return f"building kvforge's C++ kernels ({self._seconds()} s)"

    def _tick(self) -> None:
        next_log = self.log_every_s
        while not self._stop.wait(TICK_S if self._status is not None else min(TICK_S, self.log_every_s)):
            if self._status is not None:
                self._status.update(self._spinner_text())
            elif time.monotonic() - self._start >= next_log:
                self._write(f"kvforge: still building the C++ kernels ({self._seconds()} s so far)")
                next_log += self.log_every_s

    def _write(self, line: str) -> None:
        try:
            print(line, file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed stderr must not fail the build
            pass


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def failure_summary(exc: BaseException) -> str:
    """The lines of a failed `torch.utils.cpp_extension.load` that say what failed:
    the failing command (without include paths and defines) and the compiler's
    first error lines, instead of ninja's whole log."""
    if isinstance(exc, subprocess.CalledProcessError):  # torch runs the compiler to check it first
        output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        said = f": {output.strip().splitlines()[0]}" if output.strip() else ""
        command = shlex.join(exc.cmd) if isinstance(exc.cmd, list) else str(exc.cmd)
        return f"the compiler check `{command}` exited with status {exc.returncode}{said}"
    lines = str(exc).splitlines()
    failed = [i for i, line in enumerate(lines) if line.startswith("FAILED:")]
    if not failed:
        return "\n".join(lines[:ERROR_LINES])
    first = failed[0]
    command = lines[first + 1] if first + 1 < len(lines) else ""
    said = []
    for line in lines[first + 2:]:
        if line.startswith(("FAILED:", "ninja:")) or (line.startswith("[") and "/" in line.split("]")[0]):
            break
        said.append(line)
    errors = [line for line in said if "error" in line.lower()] or said
    others = f" ({len(failed) - 1} other command(s) failed too)" if len(failed) > 1 else ""
    quoted = "\n".join(f"  {line}" for line in errors[:ERROR_LINES])
    return f"`{short_command(command)}` failed{others}:\n{quoted}"


def short_command(command: str) -> str:
    """A compile or link command as a person compares it with their toolchain: the
    compiler, the flags and the file, without include paths, defines and outputs."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return command
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in NOISE_WITH_VALUE:
            skip = True
        elif not arg.startswith(NOISE_PREFIXES):
            kept.append(Path(arg).name if arg.endswith((".cpp", ".o")) else arg)
    return shlex.join(kept)
