"""What rank 0, the driver, does under every executor (mp, Ray, torchrun).

The engine's own process is rank 0, as vLLM's driver worker: it runs the
scheduler, the block allocator and sampling once, holds shard 0 (or stage 0)
of the weights and the KV cache, and computes the logits. Each step it
broadcasts the plan to the other ranks (`DriverRunner`) before running its own
shard. An executor differs only in how the other ranks start, are watched and
stop, and where they meet: `DriverExecutor` leaves those to its subclasses.

A worker that dies or hangs never hangs the engine: every collective has
`parallel.collective_timeout_s`, the workers' liveness is checked before every
step, and a failure becomes a `DistributedError` naming the rank (with the
worker's own error when it could write one), after which the other workers
are stopped and the engine refuses further steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kvforge.core import DistributedError, EngineConfig, Quantizer
from kvforge.engine.model_runner import ModelRunner, copy_blocks, logit_rows, token_slots_of

from . import step_message
from .group import STARTUP_TIMEOUT_S
from .layout import RankGroups, build_groups
from .rank_step import RankStep
from .shard_loading import WorkerSpec, check_split, load_shard
from .timing import RankTiming, StageTimer, gather_timings
from .worker import NUM_BLOCKS_KEY, error_key, loaded_key, ready_key, report_memory

STOP_WAIT_S = 10.0  # how long a worker gets to leave its loop before it is terminated
DEATH_SETTLE_S = 2.0  # a peer's socket can close a moment before its death is visible


class DriverExecutor:
    """Rank 0 of a tensor- or pipeline-parallel engine (follows `kvforge.engine.executors.Executor`).

    A subclass provides where the ranks meet (`_rendezvous`), the driver's device,
    and how the other ranks start (`_start_workers`), which of them have died
    (`_dead_workers`) and how they stop (`_stop_workers`)."""

    workers_visible = True
    """Whether `_dead_workers` sees a worker that died without a word (killed): False
    where the ranks are processes of another launcher (torchrun)."""

    def __init__(self, config: EngineConfig, attention_backend: type, kv_quantizer: Quantizer | None,
                 weight_quantizer: Quantizer | None, device: torch.device, dtype: torch.dtype):
        parallel = config.parallel
        self.size = parallel.world_size
        self.timeout_s = parallel.collective_timeout_s
        check_split(config)
        self.failure: DistributedError | None = None
        self.groups: RankGroups | None = None  # built once the workers are up
        self.memory: list[tuple[int, int]] = []
        self._serving = False  # True once the workers wait for steps (and so understand STOP)
        self._store, host = self._rendezvous()
        port = getattr(self._store, "port", 0)
        self._start_workers(WorkerSpec(config.model_dump(), attention_backend.name, port, torch.get_num_threads()))
        try:
            self._await_workers(ready_key, "start")
            self.groups = build_groups(self._store, 0, parallel, self._driver_device(device), host)
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

    # What a subclass provides

    def _rendezvous(self) -> tuple[dist.Store, str]:
        """The store every rank meets on, and the address the driver's sockets bind to."""
        raise NotImplementedError

    def _driver_device(self, device: torch.device) -> torch.device:
        """Rank 0's device, given the engine's (`cuda` or `cpu`)."""
        raise NotImplementedError

    def _start_workers(self, spec: WorkerSpec) -> None:
        """Start ranks 1..size-1 (or do nothing where a launcher started them)."""
        raise NotImplementedError

    def _dead_workers(self) -> list[tuple[int, str]]:
        """(rank, how it ended, e.g. "(pid 42) was killed by signal SIGKILL") for each worker
        that is no longer running."""
        raise NotImplementedError

    def _stop_workers(self, wait_s: float) -> None:
        """Give the workers `wait_s` seconds to leave their loop, then end whatever still runs."""
        raise NotImplementedError

    # The driver

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
        if self._dead_workers():
            raise self._failed(during, None)

    def _failed(self, what: str, exc: Exception | None) -> DistributedError:
        """The error for a failed collective or a dead worker: names the rank, then
        stops the other workers (the group is unusable past a failure)."""
        deadline = time.monotonic() + (DEATH_SETTLE_S if self.workers_visible else 0)
        dead = self._dead_workers()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead_workers()
        if dead:
            lines = [f"distributed worker rank {rank} {how}{self._quote(rank)}" for rank, how in dead]
            message = (f"{'; '.join(lines)}; the {what} could not complete. The engine cannot continue: shut it "
                       f"down and build a new one")
        elif self.workers_visible:
            message = (f"distributed {what} failed with every worker still running ({exc}); a rank is "
                       f"stuck or slower than parallel.collective_timeout_s = {self.timeout_s:g} s: raise it if "
                       f"steps are legitimately that slow. The engine cannot continue: build a new one")
        else:
            message = (f"distributed {what} failed ({exc}): a rank exited (its launcher's log names it) or is stuck "
                       f"or slower than parallel.collective_timeout_s = {self.timeout_s:g} s (raise it if steps are "
                       f"legitimately that slow). The engine cannot continue: build a new one")
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
        """Stop the workers: a STOP message when the group still works, then end
        whatever is still running. Idempotent."""
        if self.failure is None and self._serving and not self._dead_workers():
            try:
                step_message.send_command(self.group, step_message.STOP)
            except DistributedError:
                pass
        self._stop_workers(STOP_WAIT_S if self.failure is None else 0.1)
        if self.groups is not None:
            self.groups.close()
        if self.failure is None:
            self.failure = DistributedError("this distributed engine was shut down; build a new one")


class DriverRunner(ModelRunner):
    """The driver's `ModelRunner`: each step goes to the workers before rank 0 runs its part."""

    def __init__(self, executor: DriverExecutor, kv, kv_caches: list[torch.Tensor], block_size: int):
        super().__init__(executor.model, kv, kv_caches, block_size, executor.group.device)
        self.executor = executor
        self._copies: list[tuple[int, int]] = []
        self._step = RankStep(executor.model, executor.groups)

    def apply_block_copies(self) -> int:
        self._copies = self.kv.pop_pending_copies()  # kept: the workers apply them to their shards too
        copy_blocks(self.kv_caches, self._copies, self.device)
        return len(self._copies)

    def run(self, scheduled, input_ids, positions, batch, lora_slots) -> torch.Tensor:
        rows = torch.tensor(logit_rows(scheduled), dtype=torch.int64)
        token_slots = token_slots_of(scheduled, lora_slots)
        self.executor.check_workers("step")
        step_message.send_step(self.executor.group,
                               step_message.StepMessage(input_ids, positions, batch, self._copies, rows, token_slots))
        self._copies = []
        with self.executor.timer:
            return self._step.run(input_ids, positions, self.kv_caches, batch, rows, token_slots)

    def load_lora(self, slot: int, path: str, fingerprint: str) -> None:
        """Have every worker load the adapter in `path` into `slot` (rank 0 loads its own)."""
        self.executor.check_workers("LoRA adapter load")
        step_message.send_lora(self.executor.group, step_message.LoRALoad(slot, path, fingerprint))
