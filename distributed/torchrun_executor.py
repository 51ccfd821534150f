"""The torchrun executor (`parallel.executor = "torchrun"`, alias "external"): ranks another launcher started.

torchrun (or any launcher that sets torch's env:// variables: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) starts the same command on
every rank, on one host or several. Each process builds the same engine; the
ranks meet on the launcher's store (env://). Rank 0 becomes the driver and
returns from the engine's constructor to run `generate` or `serve`; every
other rank runs the worker loop inside the constructor and then ends its
process (`SystemExit(0)`) when the driver shuts down, so code after the
engine's construction runs on rank 0 only.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvforge.core import ConfigError

from .driver import DriverExecutor
from .group import STARTUP_TIMEOUT_S, address_towards
from .shard_loading import WorkerSpec, rank_device
from .worker import error_key, work

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_engines = itertools.count()  # every rank builds its engines in the same order: the same count names the same engine


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in the launch, read from torch's env:// variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str

    @classmethod
    def from_environment(cls, world_size: int) -> "LaunchedRank":
        missing = [name for name in ENV if name not in os.environ]
        if missing:
            raise ConfigError(
                f"parallel.executor = 'torchrun' runs in processes torchrun started, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set; launch every rank with e.g. `torchrun "
                f"--nproc-per-node {world_size} -m kvforge generate --tensor-parallel-size {world_size} ...`, or "
                "choose parallel.executor = 'mp' (one host) or 'ray'")
        launched = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                       os.environ["MASTER_ADDR"])
        if launched.world_size != world_size:
            raise ConfigError(
                f"torchrun started {launched.world_size} processes (WORLD_SIZE) but parallel.tensor_parallel_size x "
                f"pipeline_parallel_size = {world_size}; start exactly one process per rank (--nnodes x "
                f"--nproc-per-node = {world_size})")
        return launched


class TorchrunExecutor(DriverExecutor):
    """Rank 0 of a tensor- or pipeline-parallel engine whose other ranks torchrun started.

    On a rank other than 0 the constructor never returns: it serves as a worker, then
    raises `SystemExit(0)` once the driver stops (or lets the worker's error through)."""

    workers_visible = False  # their processes belong to torchrun: a killed one is seen only as a failed collective

    def __init__(self, config, attention_backend, kv_quantizer, weight_quantizer, device, dtype):
        self.launched = LaunchedRank.from_environment(config.parallel.world_size)
        self._host = address_towards(self.launched.master_addr)
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S)))
        self._launch_store = dist.PrefixStore(f"kvforge/engine{next(_engines)}", store)
        if self.launched.rank != 0:
            spec = WorkerSpec(config.model_dump(), attention_backend.name, 0, torch.get_num_threads())
            work(spec, self.launched.rank, self._launch_store, self._host, self.launched.local_rank)
            raise SystemExit(0)
        super().__init__(config, attention_backend, kv_quantizer, weight_quantizer, device, dtype)
        # A driver that exits without shutdown() (a server stopped by a signal) still tells the other
        # ranks to stop, so they exit 0 instead of failing their next collective.
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    def _rendezvous(self) -> tuple[dist.Store, str]:
        return self._launch_store, self._host

    def _driver_device(self, device: torch.device) -> torch.device:
        return rank_device(device, self.launched.local_rank)

    def _start_workers(self, spec: WorkerSpec) -> None:
        pass  # torchrun started them

    def _dead_workers(self) -> list[tuple[int, str]]:
        """The ranks that wrote an error before they ended (a killed one cannot)."""
        try:
            return [(rank, "failed") for rank in range(1, self.size) if self._store.check([error_key(rank)])]
        except RuntimeError:  # the store's host (the torchrun agent) is gone
            return []

    def _stop_workers(self, wait_s: float) -> None:
        pass  # STOP (sent by shutdown) ends their loop; after a failure their collectives time out


def _shutdown_at_exit(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()
