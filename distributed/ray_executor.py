"""The Ray executor (`parallel.executor = "ray"`): workers as Ray actors, on any node of a cluster.

Ranks 1..size-1 are Ray actors, one per rank, each asking Ray for what it uses:
`parallel`'s thread count of CPUs on CPU, one GPU on CUDA (Ray gives the actor
that GPU as its device 0). Each runs the same worker loop as an mp worker
(`worker.run_worker`), meeting the driver on a TCP store at the driver's node
address. The engine's process stays rank 0, outside Ray's resources.

Ray is joined, not owned: an initialized Ray is used as it is; otherwise
`ray.init()` connects to the cluster `RAY_ADDRESS` names (or one started on this
host with `ray start --head`), else starts a local instance, which `shutdown()`
stops again. Needs `pip install 'kvforge[ray]'`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from kvforge.core import ConfigError, UnsupportedConfigurationError

from .driver import DriverExecutor
from .group import address_towards, driver_store
from .shard_loading import WorkerSpec, rank_device
from .worker import run_worker

KILL_WAIT_S = 5.0  # how long a killed actor may take before its end is no longer awaited


def import_ray():
    """The `ray` module, or a ConfigError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("parallel.executor = 'ray' needs Ray, which is not installed: pip install "
                          "'kvforge[ray]' (or choose parallel.executor = 'mp' on one host)") from exc
    return ray


class RankActor:
    """One worker rank inside a Ray actor."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: WorkerSpec, rank: int, store_host: str, device_index: int | None) -> None:
        """The worker's whole life; returns when the driver says STOP."""
        run_worker(spec, rank, store_host, device_index)


class RayExecutor(DriverExecutor):
    """Rank 0 of a tensor- or pipeline-parallel engine whose other ranks are Ray actors.

    `actors` are ranks 1.. (`actor_pids` their process ids); a dead actor fails the
    engine with a `DistributedError` naming its rank, as a dead mp worker does."""

    def __init__(self, config, attention_backend, kv_quantizer, weight_quantizer, device, dtype):
        self.ray = import_ray()
        self._owns_ray = not self.ray.is_initialized()
        if self._owns_ray:
            self.ray.init()
        self.actors: list = []
        self._runs: list = []
        self._pids: list = []
        self._cuda = device.type == "cuda"
        try:
            super().__init__(config, attention_backend, kv_quantizer, weight_quantizer, device, dtype)
        except BaseException:
            self._release_ray()
            raise

    def _rendezvous(self) -> tuple[dist.Store, str]:
        self._driver_host = self.ray.util.get_node_ip_address()
        return driver_store(self.size, self._driver_host), address_towards(self._driver_host)

    def _driver_device(self, device: torch.device) -> torch.device:
        return rank_device(device, 0)

    def _start_workers(self, spec: WorkerSpec) -> None:
        need = {"GPU": 1.0} if self._cuda else {"CPU": float(spec.threads)}
        check_resources(self.ray.cluster_resources(), need, self.size - 1)
        actor_class = self.ray.remote(RankActor)
        for rank in range(1, self.size):
            options = {"num_gpus": 1, "num_cpus": 1} if self._cuda else {"num_cpus": spec.threads}
            actor = actor_class.options(max_restarts=0, **options).remote()
            self.actors.append(actor)
            self._pids.append(actor.pid.remote())  # before `run`, which keeps the actor busy for good
            self._runs.append(actor.run.remote(spec, rank, self._driver_host, 0 if self._cuda else None))

    @property
    def actor_pids(self) -> list[int]:
        """The process id of each worker rank's actor, rank 1 first."""
        return self.ray.get(self._pids, timeout=self.timeout_s)

    def _dead_workers(self) -> list[tuple[int, str]]:
        if not self._runs:
            return []
        done, _ = self.ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return [(rank, self._how_it_ended(rank)) for rank, run in enumerate(self._runs, start=1) if run in done]

    def _how_it_ended(self, rank: int) -> str:
        try:
            actor = f"(Ray actor, pid {self.ray.get(self._pids[rank - 1], timeout=0)})"
        except self.ray.exceptions.RayError:  # it died before it could say
            actor = "(Ray actor)"
        try:
            self.ray.get(self._runs[rank - 1], timeout=0)
        except self.ray.exceptions.RayActorError as exc:
            return f"{actor} died: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        except self.ray.exceptions.RayTaskError as exc:
            return f"{actor} failed with {type(exc.cause).__name__ if exc.cause else 'an error'}"
        return f"{actor} left its loop"

    def _stop_workers(self, wait_s: float) -> None:
        if self._runs:
            self.ray.wait(self._runs, num_returns=len(self._runs), timeout=wait_s)
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        if self._runs:  # so a later engine on the same Ray finds the resources free
            self.ray.wait(self._runs, num_returns=len(self._runs), timeout=KILL_WAIT_S)
        self.actors, self._runs, self._pids = [], [], []
        self._release_ray()

    def _release_ray(self) -> None:
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self._owns_ray = False


def check_resources(total: dict[str, float], need: dict[str, float], workers: int) -> None:
    """Refuse, before any actor is asked for, a cluster that cannot hold the workers at once
    (a Ray actor without resources waits forever)."""
    for resource, amount in need.items():
        if total.get(resource, 0.0) < amount * workers:
            raise UnsupportedConfigurationError(
                f"the Ray cluster has {total.get(resource, 0.0):g} {resource}(s) but {workers} worker rank(s) need "
                f"{amount:g} each ({amount * workers:g}); add nodes (ray start --address ...), lower "
                f"parallel.tensor_parallel_size / pipeline_parallel_size, or (CPU) fewer torch threads per rank")
