"""A worker (ranks 1..size-1: a process, a Ray actor, a torchrun rank): load its shard or stage, then run steps.

The worker has no scheduler, allocator or sampler: each step it receives the
driver's plan (`step_message`), applies the block copies to its KV shard and
runs its part of the model, meeting the other ranks in the layers'
all-reduces (tensor parallelism) and at the stage hand-offs (pipeline
parallelism); stage-0 ranks holding a vocabulary slice of the LM head compute
their slice of the sampled logits for rank 0 (`rank_step`). Any failure is written to
the rendezvous store under `error/RANK`, so the driver can quote it when it
names this rank.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from kvforge.engine import components
from kvforge.engine.model_runner import copy_blocks
from kvforge.models import heap
from kvforge.models.lora_adapter import load_peft_adapter

from . import step_message
from .group import HOST, RankGroup, address_towards, worker_store
from .layout import RankGroups, build_groups
from .rank_step import RankStep
from .shard_loading import WorkerSpec, load_worker_shard, rank_device
from .timing import StageTimer, gather_timings


NUM_BLOCKS_KEY = "num_blocks"


def error_key(rank: int) -> str:
    return f"error/{rank}"


def ready_key(rank: int) -> str:
    """Set once the rank is up and about to join the process group."""
    return f"ready/{rank}"


def loaded_key(rank: int) -> str:
    """Set once the rank holds its part of the model."""
    return f"loaded/{rank}"


def run_worker(spec: WorkerSpec, rank: int, store_host: str = HOST, device_index: int | None = None) -> None:
    """The worker's whole life when the driver started it (mp, Ray): meet the driver's
    rendezvous store at `store_host:spec.port`, then `work`."""
    store = worker_store(spec.port, spec.engine_config.parallel.world_size, store_host)
    work(spec, rank, store, address_towards(store_host), device_index)


def work(spec: WorkerSpec, rank: int, store: dist.Store, host: str, device_index: int | None = None) -> None:
    """Load rank `rank`'s part, then run steps until the driver says STOP. `host` is the
    address this rank's sockets bind to; `device_index` the CUDA device it uses (default:
    its rank, one host's devices in rank order)."""
    config = spec.engine_config
    torch.set_num_threads(spec.threads)
    groups = None
    try:
        device = rank_device(components.resolve_device(config), rank if device_index is None else device_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif config.keep_freed_memory:  # as the driver does (LLMEngine): no page faults on each step's activations
            heap.keep_freed_memory()
        store.set(ready_key(rank), "1")
        groups = build_groups(store, rank, config.parallel, device, host)
        model = load_worker_shard(spec, groups)
        if device.type == "cpu":
            heap.release_free_memory()  # what loading freed, as the driver does
        store.set(loaded_key(rank), "1")
        # The driver's block count comes through the store, which waits minutes, not through a
        # collective, which waits seconds: the driver may still be loading its own shard.
        serve(model, groups, config.cache.block_size, int(store.get(NUM_BLOCKS_KEY)))
    except BaseException:
        store.set(error_key(rank), traceback.format_exc()[-4000:])
        raise
    finally:
        if groups is not None:
            groups.close()


@torch.inference_mode()
def serve(model, groups: RankGroups, block_size: int, num_blocks: int) -> None:
    """Allocate this rank's KV shard at the driver's block count, report memory, then run
    steps (and answer timing reports) until STOP."""
    group = groups.world
    kv_caches = model.allocate_kv_cache(num_blocks, block_size)
    report_memory(group, model, kv_caches)
    timer = StageTimer(groups)
    step = RankStep(model, groups)
    while True:
        command, message = step_message.receive(group, block_size)
        if command == step_message.STOP:
            return
        if command == step_message.REPORT:
            gather_timings(group, timer)
            continue
        if command == step_message.LORA:
            load_lora(model, message)
            continue
        copy_blocks(kv_caches, message.copies, group.device)
        with timer:
            step.run(message.input_ids, message.positions, kv_caches, message.batch, message.logit_rows,
                     message.token_slots)


def load_lora(model, load: step_message.LoRALoad) -> None:
    """Load the driver's adapter into `load.slot`, cut to this rank's part; the files
    must still hold the weights the driver loaded (their fingerprint)."""
    adapter = load_peft_adapter(load.path, model, max_rank=model.lora.max_rank)
    if adapter.fingerprint != load.fingerprint:
        raise RuntimeError(f"LoRA adapter {load.path} changed on disk between the driver's load and this rank's "
                           "(its weights' fingerprint differs); every rank must read the same files")
    model.lora.load(load.slot, adapter)


def report_memory(group: RankGroup, model, kv_caches: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Every rank's (weight bytes, KV cache bytes), by rank; every rank calls it once."""
    kv_bytes = sum(c.numel() * c.element_size() for c in kv_caches)
    mine = torch.tensor([model.weight_bytes(), kv_bytes], dtype=torch.int64, device=group.device)
    return [tuple(int(v) for v in t.tolist()) for t in group.all_gather(mine)]
