"""The multiprocessing executor (`parallel.executor = "mp"`): the driver and its workers.

The engine's own process is rank 0, the driver, as vLLM's driver worker: it
runs the scheduler, the block allocator and sampling once, holds shard 0 (or
stage 0) of the weights and the KV cache, and computes the logits. `MultiprocExecutor` starts
ranks 1..size-1 as processes (torch.multiprocessing, spawn), meets them on a
TCP store on 127.0.0.1, and each step broadcasts the plan to them
(`DriverRunner`) before running its own shard.

A worker that dies or hangs never hangs the engine: every collective has
`parallel.collective_timeout_s`, the workers' liveness is checked before every
step, and a failure becomes a `DistributedError` naming the rank (with the
worker's own error when it could write one), after which the other workers
are stopped and the engine refuses further steps.
"""

from __future__ import annotations

import signal
import time
import weakref

import torch
import torch.multiprocessing as mp

from kvforge.core import DistributedError, EngineConfig, Quantizer, UnsupportedConfigurationError
from kvforge.engine.model_runner import ModelRunner, copy_blocks, logit_rows

from . import step_message
from .group import STARTUP_TIMEOUT_S, driver_store
from .layout import build_groups
from .rank_step import RankStep
from .shard_loading import WorkerSpec, check_split, load_shard, rank_device
from .timing import RankTiming, StageTimer, gather_timings
from .worker import NUM_BLOCKS_KEY, error_key, loaded_key, ready_key, report_memory, run_worker

STOP_WAIT_S = 10.0  # how long a worker gets to leave its loop before it is terminated
TERMINATE_WAIT_S = 2.0  # how long a terminated worker gets to exit before it is killed
DEATH_SETTLE_S = 2.0  # a peer's socket can close a moment before the OS reports its exit


class MultiprocExecutor:
    """Rank 0 of a tensor- or pipeline-parallel engine plus its worker processes.

    `model` is the driver's shard; `runner(...)` gives the engine its
    `ModelRunner`; `memory` lists each rank's (weight bytes, KV cache bytes)
    once the runner exists; `shutdown()` stops the workers (also on garbage
    collection and at exit)."""

    def __init__(self, config: EngineConfig, attention_backend: type, kv_quantizer: Quantizer | None,
                 weight_quantizer: Quantizer | None, device: torch.device, dtype: torch.dtype):
        parallel = config.parallel
        self.size = config.parallel.world_size
        self.timeout_s = parallel.collective_timeout_s
        check_devices(device, self.size)
        check_split(config)
        self.failure: DistributedError | None = None
        self.memory: list[tuple[int, int]] = []
        self._serving = False  # True once the workers wait for steps (and so understand STOP)
        self._store = driver_store(self.size)
        spec = WorkerSpec(config.model_dump(), attention_backend.name, self._store.port, torch.get_num_threads())
        context = mp.get_context("spawn")
        self.workers = [context.Process(target=run_worker, args=(spec, rank), name=f"kvforge-rank{rank}",
                                        daemon=True) for rank in range(1, self.size)]
        for worker in self.workers:
            worker.start()
        self._finalizer = weakref.finalize(self, _terminate, list(self.workers))
        try:
            self._await_workers(ready_key, "start")
            self.groups = build_groups(self._store, 0, parallel, rank_device(device, 0))
            self.group = self.groups.world
            for group in self.groups.groups:
                group.on_failure = self._failed
            self.model = load_shard(config, self.groups, dtype, attention_backend, kv_quantizer, weight_quantizer)
        except RuntimeError as exc:
            if isinstance(exc, DistributedError):
                raise
            raise self._failed("start-up", exc) from exc  # the store or the group timed out: say which rank
        except BaseException:
            self.shutdown()  # e.g. a ConfigError from loading: the workers hit it too, or are stopped here
            raise

    def runner(self, kv, kv_caches: list[torch.Tensor], block_size: int, num_blocks: int) -> "DriverRunner":
        """The engine's runner over the driver's KV shard; tells the workers to allocate
        theirs at `num_blocks` blocks, and gathers every rank's memory figures."""
        self._await_workers(loaded_key, "load its part of the model")
        self._store.set(NUM_BLOCKS_KEY, str(num_blocks))
        self.memory = report_memory(self.group, self.model, kv_caches)
        self.timer = StageTimer(self.groups)
        self._serving = True
        return DriverRunner(self, kv, kv_caches, block_size)

    def _await_workers(self, key, what: str) -> None:
        """Wait, up to `STARTUP_TIMEOUT_S`, until every worker has set `key(rank)` in the
        store; a worker that exits meanwhile is named at once, one that never does at the end."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = list(range(1, self.size))
        while pending:
            self.check_workers("start-up")
            pending = [rank for rank in pending if not self._store.check([key(rank)])]
            if pending and time.monotonic() > deadline:
                self.failure = DistributedError(
                    f"distributed worker rank(s) {', '.join(map(str, pending))} did not {what} within "
                    f"{STARTUP_TIMEOUT_S:g} s; the engine cannot start")
                self.shutdown()
                raise self.failure
            time.sleep(0.02 if pending else 0)

    def timings(self) -> list[RankTiming]:
        """Every rank's forward, compute and communication seconds since it started, by
        rank (for pipeline stages: each stage's compute; for tensor parallelism: the
        communication share)."""
        self.check_workers("timing report")
        step_message.send_command(self.group, step_message.REPORT)
        return gather_timings(self.group, self.timer)

    def check_workers(self, during: str) -> None:
        """Raise the executor's failure, or a new one if a worker has exited."""
        if self.failure is not None:
            raise self.failure
        if any(not w.is_alive() for w in self.workers):
            raise self._failed(during, None)

    def _failed(self, what: str, exc: Exception | None) -> DistributedError:
        """The error for a failed collective or a dead worker: names the rank, then
        stops the other workers (the group is unusable past a failure)."""
        deadline = time.monotonic() + DEATH_SETTLE_S
        while not any(w.exitcode is not None for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [(rank, w) for rank, w in enumerate(self.workers, start=1) if w.exitcode is not None]
        if dead:
            lines = [f"distributed worker rank {rank} (pid {w.pid}) {exit_reason(w.exitcode)}{self._quote(rank)}"
                     for rank, w in dead]
            message = (f"{'; '.join(lines)}; the {what} could not complete. The engine cannot continue: shut it "
                       f"down and build a new one")
        else:
            message = (f"distributed {what} failed with every worker process still running ({exc}); a rank is "
                       f"stuck or slower than parallel.collective_timeout_s = {self.timeout_s:g} s: raise it if "
                       f"steps are legitimately that slow. The engine cannot continue: build a new one")
        self.failure = DistributedError(message)
        self.shutdown()
        return self.failure

    def _quote(self, rank: int) -> str:
        try:
            if self._store.check([error_key(rank)]):
                return f"; its error:\n{self._store.get(error_key(rank)).decode(errors='replace')}"
        except RuntimeError:
            pass
        return ""

    def shutdown(self) -> None:
        """Stop the workers: a STOP message when the group still works, then terminate
        whatever is still running. Idempotent."""
        if self.failure is None and self._serving and all(w.is_alive() for w in self.workers):
            try:
                step_message.send_command(self.group, step_message.STOP)
            except DistributedError:
                pass
        for worker in self.workers:
            worker.join(STOP_WAIT_S if self.failure is None else 0.1)
        self._finalizer()
        if self.failure is None:
            self.failure = DistributedError("this distributed engine was shut down; build a new one")


def _terminate(workers) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(TERMINATE_WAIT_S)
        if worker.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
            worker.kill()
            worker.join(TERMINATE_WAIT_S)


def exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "is running"
    if exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def check_devices(device: torch.device, size: int) -> None:
    """Refuse a rank count the host's devices cannot hold."""
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise UnsupportedConfigurationError(
            f"parallel.tensor_parallel_size x pipeline_parallel_size = {size} ranks need {size} CUDA devices, one "
            f"per rank, but this host has {torch.cuda.device_count()}; lower it, or run on CPU (device = 'cpu') "
            "where the ranks share the host")


class DriverRunner(ModelRunner):
    """The driver's `ModelRunner`: each step goes to the workers before rank 0 runs its part."""

    def __init__(self, executor: MultiprocExecutor, kv, kv_caches: list[torch.Tensor], block_size: int):
        super().__init__(executor.model, kv, kv_caches, block_size, executor.group.device)
        self.executor = executor
        self._copies: list[tuple[int, int]] = []
        self._step = RankStep(executor.model, executor.groups)

    def apply_block_copies(self) -> int:
        self._copies = self.kv.pop_pending_copies()  # kept: the workers apply them to their shards too
        copy_blocks(self.kv_caches, self._copies, self.device)
        return len(self._copies)

    @torch.inference_mode()
    def execute(self, scheduled) -> torch.Tensor:
        self.apply_block_copies()
        input_ids, positions, batch = self.build_batch(scheduled)
        rows = logit_rows(scheduled)
        self.executor.check_workers("step")
        step_message.send_step(self.executor.group,
                               step_message.StepMessage(input_ids, positions, batch, self._copies, rows))
        self._copies = []
        with self.executor.timer:
            return self._step.run(input_ids, positions, self.kv_caches, batch, rows)
