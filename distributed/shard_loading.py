"""How every rank, driver or worker, loads its shard of the model: one path.

A rank loads the checkpoint in float, keeps its slice (`shard_model` under tensor
parallelism, its stage under pipeline parallelism: `split_stages`), and only
then quantizes and packs its linear layers and takes the KV quantizer and the
attention backend (all inside `load_model`). The whole checkpoint passes
through each rank's memory once while loading; what stays is its slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.core import ATTENTION_BACKEND, EngineConfig, Quantizer, build_registry
from kvforge.engine import components
from kvforge.models import load_model
from kvforge.models.base import CausalLM

from .layout import RankGroups, RankLayout, SoloGroup
from .pipeline_parallel import split_stages
from .tensor_parallel import shard_model
from .vocab_parallel import drop_head


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs, by value (it crosses a spawn): the engine config,
    the attention backend the driver selected, and where to meet the driver."""

    config: dict[str, Any]
    attention_backend: str
    port: int
    threads: int

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig.model_validate(self.config)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: its own GPU on CUDA, the host on CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def load_shard(config: EngineConfig, groups: RankGroups, dtype: torch.dtype, attention_backend: type,
               kv_quantizer: Quantizer | None, weight_quantizer: Quantizer | None) -> CausalLM:
    """This rank's shard of `config.model`, ready to run."""
    return load_model(config.model, dtype=dtype, device=groups.world.device, attention_backend=attention_backend,
                      linear_kernel=config.linear_kernel, kv_quantizer=kv_quantizer,
                      weight_quantizer=weight_quantizer, weight_activations=config.quantization.activations,
                      shard=lambda model: keep_part(model, groups))


def keep_part(model: CausalLM, groups: RankGroups) -> None:
    """Keep this rank's part of a loaded float model: its tensor-parallel shard of its
    pipeline stage (either may be the whole)."""
    shard_model(model, groups.tp, vocab_parallel=groups.layout.vocab_parallel)
    split_stages(model, groups)
    if not groups.layout.computes_logits:
        drop_head(model)


@dataclass(frozen=True)
class DryRunRank:
    """Rank 0 of `size`, for splitting a meta-device model: no collective is ever called."""

    size: int
    rank: int = 0
    device: torch.device = torch.device("meta")


def check_split(config: EngineConfig) -> None:
    """Split a meta-device copy of `config.model` as rank 0 will, so a split the model
    cannot take (heads, features or layers that do not divide, an architecture
    without shards) is refused, with the sizes that work, before any process starts."""
    from kvforge.models.loader import load_config, resolve_model_dir
    from kvforge.models.registry import model_class

    model_config = load_config(resolve_model_dir(config.model))
    with torch.device("meta"):
        model = model_class(model_config.get("architectures") or [])(model_config)
        model.finish_loading()
        keep_part(model, dry_run_groups(config))


def dry_run_groups(config: EngineConfig) -> RankGroups:
    """Rank 0's groups, without processes: for splitting a meta-device model."""
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    layout = RankLayout(tp, parallel.pipeline_parallel_size, 0, parallel.vocab_parallel and tp > 1)
    world = DryRunRank(parallel.world_size)
    return RankGroups(layout, world, DryRunRank(tp) if tp > 1 else SoloGroup(world.device))


def load_worker_shard(spec: WorkerSpec, groups: RankGroups) -> CausalLM:
    """A worker's shard, its implementations resolved by name as the driver's were."""
    config = spec.engine_config
    plugins = config.plugins
    registry = build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict)
    backend = registry.select(ATTENTION_BACKEND, spec.attention_backend).cls
    dtype = components.resolve_dtype(config, groups.world.device)
    return load_shard(config, groups, dtype, backend, components.resolve_kv_quantizer(registry, config),
                      components.weight_quantizer(registry, config))
