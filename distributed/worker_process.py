"""A worker rank of the mp executor as a fresh interpreter (`WorkerProcess`).

The process runs `python -c BOOTSTRAP`, which reads the parent's `sys.path` and
the pickled (spec, rank) from its stdin, then runs `worker.run_worker`. Unlike
multiprocessing's spawn it never imports the parent's main script again, so a
script without an `if __name__ == "__main__":` guard runs as written (spawn
would run the script's engine again in every worker). Unlike fork it inherits
no threads and no CUDA state: a forked child of a process whose OpenMP pool has
run hangs in its first parallel operation, and one of a process that
initialised CUDA cannot use it.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

from .shard_loading import WorkerSpec

# Reads (sys.path, payload) before anything of kvforge is imported: the payload's
# classes are found on the parent's path, wherever the parent imported kvforge from.
BOOTSTRAP = """\
import pickle, sys
path, payload = pickle.load(sys.stdin.buffer)
sys.path[:] = path
from kvforge.distributed.worker import run_worker
run_worker(*pickle.loads(payload))
"""


class WorkerProcess:
    """One worker rank's interpreter, with the calls of `multiprocessing.Process`
    the executor uses: `pid`, `exitcode` (negative: killed by that signal; None
    while running), `is_alive`, `join`, `terminate`, `kill`."""

    def __init__(self, spec: WorkerSpec, rank: int):
        self._popen = subprocess.Popen([sys.executable, "-c", BOOTSTRAP], stdin=subprocess.PIPE)
        try:
            with self._popen.stdin as pipe:
                pickle.dump((list(sys.path), pickle.dumps((spec, rank))), pipe)
        except BrokenPipeError:  # it died at once; `exitcode` says how, the executor names it
            pass

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()
