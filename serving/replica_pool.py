"""The API process's side of the data-parallel replicas: their processes and pipes.

Each replica is a process started with torch.multiprocessing's `spawn` (a fresh
interpreter: no forked torch threads or CUDA state). Commands go down one pipe,
results come back up another. The event loop reads results itself whenever the
pipe is readable (a replica writes each message whole, so reading one never
waits on a step); commands go out through a writer thread, so a large prompt
never blocks the event loop while the replica is busy stepping. A replica's
death reads as end of file on its results pipe.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvforge.engine.process_exit import describe_exit

from .replica_process import ReplicaInfo, ReplicaSpec, replica_main

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a replica told to stop ends its current step first


class ReplicaStartError(RuntimeError):
    """A replica could not build its engine (its own error is in the message)."""


class ReplicaHandle:
    """One replica's process, its two pipes and, once attached, its two threads."""

    def __init__(self, index: int, spec: ReplicaSpec, context):
        self.index = index
        commands_out, self._commands = context.Pipe(duplex=False)
        self._results, results_in = context.Pipe(duplex=False)
        self.process = context.Process(target=replica_main, args=(index, spec, commands_out, results_in),
                                       name=f"kvforge-replica-{index}", daemon=True)
        self.process.start()
        # Our copies of the child's ends closed, so the child's death reads as end of file here.
        commands_out.close()
        results_in.close()
        self.info: ReplicaInfo | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reading, self._loop = False, None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> ReplicaInfo:
        """Block until the engine is built; raises `ReplicaStartError` with the replica's reason."""
        while not self._results.poll(1.0):
            if not self.process.is_alive() and not self._results.poll(0):
                self.process.join()
                raise ReplicaStartError(f"data-parallel replica {self.index} "
                                        f"{describe_exit(self.pid, self.process.exitcode)} while starting; see its "
                                        "output above")
        try:
            message = self._results.recv()
        except EOFError:
            self.process.join()
            raise ReplicaStartError(f"data-parallel replica {self.index} "
                                    f"{describe_exit(self.pid, self.process.exitcode)} while starting") from None
        if message[0] == "error":
            raise ReplicaStartError(f"data-parallel replica {self.index} could not start: {message[1]}")
        self.info = message[1]
        return self.info

    def attach(self, loop, on_message: Callable, on_death: Callable) -> None:
        """Start moving messages: each result becomes `on_message(index, message)`
        on the event loop, which reads the results pipe itself when it is readable
        (no thread in between: one wake-up per step, not two); end of file becomes
        `on_death(index, exitcode)`. Commands go out through a writer thread."""
        def drain() -> None:
            try:
                while self._results.poll(0):  # every message already there, in one wake-up
                    on_message(self.index, self._results.recv())
            except (EOFError, OSError):
                loop.remove_reader(self._results.fileno())
                self._reading = False
                died = loop.run_in_executor(None, self.process.join, 5)
                died.add_done_callback(lambda _: on_death(self.index, self.process.exitcode))

        def write() -> None:
            while (message := self._outbox.get()) is not None:
                try:
                    self._commands.send(message)
                except (OSError, ValueError):  # the replica is gone; the reader reports it
                    return

        loop.add_reader(self._results.fileno(), drain)
        self._reading, self._loop = True, loop
        self._writer = threading.Thread(target=write, name=f"kvforge-replica-{self.index}-write", daemon=True)
        self._writer.start()

    def detach(self) -> None:
        """Stop reading results (on the event loop's thread), before a stop on
        purpose: the end of file that follows is no death to report."""
        if self._reading:
            self._loop.remove_reader(self._results.fileno())
            self._reading = False

    def send(self, message: tuple) -> None:
        self._outbox.put(message)

    def ask_to_stop(self) -> None:
        """Tell the replica to stop (it aborts what it holds and exits)."""
        if self._writer is not None:
            self.send(("stop",))
            self._outbox.put(None)
        else:  # never attached: no writer thread, so send directly
            try:
                self._commands.send(("stop",))
            except (OSError, ValueError):
                pass

    def wait_stopped(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the process to end; terminate, then kill, one that does not."""
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("replica %d did not stop within %.0f s; terminating it", self.index, timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._commands.close()
        if self._writer is not None:
            self._writer.join(timeout=5)
        self._results.close()


class ReplicaPool:
    """N replicas started together (they build their engines in parallel)."""

    def __init__(self, replicas: list[ReplicaHandle]):
        self.replicas = replicas
        self._stopped = False

    @classmethod
    def start(cls, spec: ReplicaSpec, size: int) -> "ReplicaPool":
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        pool = cls([])
        try:
            for index in range(size):
                pool.replicas.append(ReplicaHandle(index, spec, context))
            for replica in pool.replicas:
                replica.wait_ready()
        except BaseException:
            pool.stop()
            raise
        return pool

    @property
    def model(self):
        """The served model's facts (every replica loads the same model)."""
        return self.replicas[0].info.model

    def stop(self) -> None:
        """Stop every replica (all told first, so they stop together); none is left running."""
        if self._stopped:
            return
        self._stopped = True
        for replica in self.replicas:
            replica.ask_to_stop()
        for replica in self.replicas:
            replica.wait_stopped()
