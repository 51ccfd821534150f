"""The ranks of one distributed engine and the collectives between them.

A `RankGroup` wraps one torch.distributed process group built from a
TCP store (gloo on CPU, NCCL on CUDA): the driver's on 127.0.0.1 for the mp
executor, on the driver's node address for Ray, torchrun's own (env://) under
torchrun. It is never the process-wide
default group: an engine's group lives and dies with the engine, so several
engines can follow one another in a process (the tests build many).

Every collective waits at most `timeout_s`. A failure (a peer that closed its
socket, a timeout) goes to `on_failure`, which the driver sets to name the rank
that died; on a worker the default raises `DistributedError` as it is.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvforge.core import DistributedError

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0
"""How long start-up (spawning, importing, loading a checkpoint) may take before a rank
that has not come up is named: minutes, where a step's collective gets seconds."""


def _default_failure(what: str, exc: Exception) -> DistributedError:
    return DistributedError(f"distributed {what} failed: {exc}")


class RankGroup:
    """This process's rank among `size` ranks, and the collectives the layers use
    (all-reduce for tensor parallelism, send and receive between pipeline stages).

    `comm_seconds` adds up the time spent inside collectives (waiting for the
    slowest rank included), so a step's communication share can be measured
    (on CUDA only the host's share: NCCL collectives run on the device's streams)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
                 host: str = HOST):
        self.rank, self.size, self.device, self.timeout_s = rank, size, torch.device(device), timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        # gloo: wait on the host, at most the timeout. NCCL: a bare wait() only orders the
        # device streams (a timeout would block the host on every collective); its watchdog
        # enforces the same timeout.
        self._wait_timeout = timeout if self.device.type != "cuda" else None
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Bound to `host` (127.0.0.1 when the ranks share this host), not to whatever the host
            # name resolves to, which may be an address the other ranks cannot reach.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self._pg = dist.ProcessGroupGloo(store, rank, size, options)
        self.comm_seconds = 0.0
        self.on_failure: Callable[[str, Exception], Exception] = _default_failure

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (contiguous) over all ranks, in place; returns `x`."""
        self._run("all-reduce", lambda: self._pg.allreduce([x]))
        return x

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite `x` on every rank with rank `root`'s `x`, in place; returns `x`."""
        self._run("broadcast", lambda: self._pg.broadcast(x, root))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on all), by rank."""
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all-gather", lambda: self._pg.allgather([out], [x]))
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` (contiguous) to rank `dst`, which must `recv` it."""
        self._run("send", lambda: self._pg.send([x], dst, 0))

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `x` with what rank `src` sends; returns `x`."""
        self._run("receive", lambda: self._pg.recv([x], src, 0))
        return x

    def close(self) -> None:
        """Release the backend's threads and sockets now, while the interpreter still
        runs: a gloo group left to the process's exit can be torn down with its
        threads mid-flight ("terminate called without an active exception", an
        abort seen in about 1 of 8 torchrun runs). Idempotent; collectives after it
        raise DistributedError."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:  # a peer already gone: nothing left to release cleanly
                pass

    def _run(self, what: str, start: Callable[[], dist.Work]) -> None:
        if self._pg is None:
            raise DistributedError(f"distributed {what} on a closed group: this engine was shut down")
        begin = time.perf_counter()
        try:
            work = start()
            if self._wait_timeout is None:
                work.wait()
            else:
                work.wait(self._wait_timeout)
        except DistributedError:
            raise
        except RuntimeError as exc:  # gloo and NCCL report a dead peer or a timeout as RuntimeError
            raise self.on_failure(what, exc) from exc
        finally:
            self.comm_seconds += time.perf_counter() - begin


def driver_store(size: int, host: str = HOST) -> dist.TCPStore:
    """The rendezvous store, held by rank 0 on a free port (`.port`) of `host`. Its
    waits (a key not there yet) last up to `STARTUP_TIMEOUT_S`: only start-up waits on it."""
    return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                         wait_for_workers=False)


def worker_store(port: int, size: int, host: str = HOST) -> dist.TCPStore:
    """A worker's client of the driver's rendezvous store at `host:port`."""
    return dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for 127.0.0.1 itself): the one
    a rank binds its gloo sockets to, so that every other rank can reach it. Sends nothing
    (connecting a UDP socket only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]
