"""The multiprocessing executor (`parallel.executor = "mp"`): workers as processes on this host.

`MultiprocExecutor` starts ranks 1..size-1 as fresh interpreters
(`worker_process`: no main script imported again, so a script without an
`if __name__ == "__main__":` guard works; no forked threads or CUDA state) and
meets them on a TCP store on 127.0.0.1; the driver's part is `DriverExecutor`'s.
Workers are stopped by `shutdown()`, on garbage collection and at exit.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from kvforge.core import UnsupportedConfigurationError
from kvforge.engine.process_exit import describe_exit

from .driver import DriverExecutor, DriverRunner
from .group import HOST, driver_store
from .shard_loading import WorkerSpec, rank_device
from .worker_process import WorkerProcess

TERMINATE_WAIT_S = 2.0  # how long a terminated worker gets to exit before it is killed

__all__ = ["DriverRunner", "MultiprocExecutor", "check_devices"]


class MultiprocExecutor(DriverExecutor):
    """Rank 0 of a tensor- or pipeline-parallel engine plus its worker processes.

    `model` is the driver's shard; `runner(...)` gives the engine its
    `ModelRunner`; `memory` lists each rank's (weight bytes, KV cache bytes)
    once the runner exists; `workers` are the processes of ranks 1..;
    `shutdown()` stops them (also on garbage collection and at exit)."""

    def __init__(self, config, attention_backend, kv_quantizer, weight_quantizer, device, dtype):
        check_devices(device, config.parallel.world_size)
        self.workers: list = []
        super().__init__(config, attention_backend, kv_quantizer, weight_quantizer, device, dtype)

    def _rendezvous(self) -> tuple[dist.Store, str]:
        return driver_store(self.size), HOST

    def _driver_device(self, device: torch.device) -> torch.device:
        return rank_device(device, 0)

    def _start_workers(self, spec: WorkerSpec) -> None:
        self.workers = [WorkerProcess(spec, rank) for rank in range(1, self.size)]
        self._finalizer = weakref.finalize(self, _terminate, list(self.workers))

    def _dead_workers(self) -> list[tuple[int, str]]:
        return [(rank, describe_exit(w.pid, w.exitcode))
                for rank, w in enumerate(self.workers, start=1) if w.exitcode is not None]

    def _stop_workers(self, wait_s: float) -> None:
        for worker in self.workers:
            worker.join(wait_s)
        self._finalizer()


def _terminate(workers) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(TERMINATE_WAIT_S)
        if worker.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
            worker.kill()
            worker.join(TERMINATE_WAIT_S)


def check_devices(device: torch.device, size: int) -> None:
    """Refuse a rank count the host's devices cannot hold."""
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise UnsupportedConfigurationError(
            f"parallel.tensor_parallel_size x pipeline_parallel_size = {size} ranks need {size} CUDA devices, one "
            f"per rank, but this host has {torch.cuda.device_count()}; lower it, run on CPU (device = 'cpu') "
            "where the ranks share the host, or use parallel.executor = 'ray' or 'torchrun' across hosts")
