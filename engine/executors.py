"""Executors: what runs the ranks of a tensor- or pipeline-parallel engine, found by name.

The engine never imports `kvforge.distributed`: `parallel.executor` names an
entry point of the `kvforge.executors` group (`mp`, `ray`, `torchrun` and its
alias `external` are kvforge's own, declared in pyproject.toml), and
`LLMEngine(config, executor=cls)` takes a class directly, as vLLM's
`distributed_executor_backend` does. Either way the class must follow `Executor`.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Protocol

import torch

from kvforge.core import ConfigError, EngineConfig, Quantizer

from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner

EXECUTOR_GROUP = "kvforge.executors"
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"  # set by torchrun in every process it starts


class Executor(Protocol):
    """Rank 0 (the driver) of a multi-rank engine and the ranks it runs with.

    The engine calls, in this order: the constructor, once; `runner`, once, after
    it sized and allocated the driver's KV cache; `shutdown`, once or more. The
    scheduler, the block allocator and sampling stay in the engine, on rank 0.
    """

    model: object
    """The driver's part of the model (its shard or stage), a `CausalLM`, set by the
    constructor: the engine sizes the KV cache from its `kv_cache_spec`."""

    memory: list[tuple[int, int]]
    """Each rank's (weight bytes, KV cache bytes), by rank, once `runner` returned."""

    def __init__(self, config: EngineConfig, attention_backend: type, kv_quantizer: Quantizer | None,
                 weight_quantizer: Quantizer | None, device: torch.device, dtype: torch.dtype) -> None:
        """Start or join the other ranks and load the driver's part of `config.model` with
        the implementations the engine selected; every rank loads its own part. Raises
        `DistributedError` naming the rank when one fails to start, and leaves nothing
        running when it raises."""

    def runner(self, kv: KVCacheManager, kv_caches: list[torch.Tensor], block_size: int,
               num_blocks: int) -> ModelRunner:
        """The engine's `ModelRunner` over the driver's KV cache; every other rank allocates
        `num_blocks` blocks of its own shard, so the driver's block table is valid on all.
        Its `execute` sends each step to the other ranks; a rank that died or stopped
        answering makes it raise `DistributedError` naming the rank, within
        `parallel.collective_timeout_s`, and every later step raises the same error."""

    def shutdown(self) -> None:
        """Stop the other ranks; idempotent. The engine cannot step afterwards."""


def installed_executors() -> dict[str, object]:
    """The entry points of the `kvforge.executors` group, by name."""
    return {ep.name: ep for ep in entry_points(group=EXECUTOR_GROUP)}


def executor_name(config: EngineConfig) -> str:
    """The executor `parallel.executor` means: `auto` is `torchrun` in a process torchrun
    started, `mp` otherwise."""
    name = config.parallel.executor
    if name == "auto":
        return "torchrun" if TORCHRUN_MARK in os.environ else "mp"
    return name


def executor_class(config: EngineConfig) -> type[Executor]:
    """The class `parallel.executor` names, loaded from its entry point."""
    name = executor_name(config)
    found = installed_executors()
    if name not in found:
        raise ConfigError(
            f"parallel.executor = {name!r} is not an installed executor; installed: "
            f"{', '.join(sorted(found)) or 'none'} (or 'auto'). A third-party executor registers an entry point "
            f"in the {EXECUTOR_GROUP!r} group; LLMEngine(config, executor=cls) takes a class directly")
    return found[name].load()
