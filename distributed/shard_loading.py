"""How every rank, driver or worker, loads its shard of the model: one path.

A rank reads only its part of the checkpoint (`RankPart.weight_slices`: its
tensor-parallel slices of its pipeline stage's weights, through safetensors'
`get_slice`), turns the float layers into its shard (`RankPart.apply`), and only
then quantizes and packs its linear layers and takes the KV quantizer and the
attention backend (all inside `load_model`). So a rank's host memory while
loading is about its part, not the checkpoint (`checkpoint_bytes_read` says how
much it read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.core import ATTENTION_BACKEND, EngineConfig, Quantizer, build_registry
from kvforge.engine import components
from kvforge.models import load_model
from kvforge.models.base import CausalLM
from kvforge.models.weight_slices import SKIP, WeightSlice, take_slices

from .layout import RankGroups, RankLayout, SoloGroup
from .pipeline_parallel import split_stages, stage_slices
from .tensor_parallel import apply_tensor_parallel, lora_slices, tensor_parallel_slices
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
                      shard=RankPart(groups), lora=config.lora if config.lora.enabled else None)


class RankPart:
    """One rank's part of a model (a `kvforge.models.weight_slices.ModelShard`): its
    tensor-parallel shard of its pipeline stage, either of which may be the whole."""

    def __init__(self, groups: RankGroups):
        self.groups, self.layout = groups, groups.layout

    def weight_slices(self, model: CausalLM) -> dict[str, WeightSlice]:
        layout = self.layout
        slices = tensor_parallel_slices(model, layout.tp_rank, layout.tp, vocab_parallel=layout.vocab_parallel)
        slices.update(stage_slices(model, layout))  # a weight of another stage is not read at all
        if not layout.computes_logits and "lm_head.weight" in dict(model.named_parameters()):
            slices["lm_head.weight"] = SKIP  # an untied head only where logits are computed
        return slices

    def lora_slices(self, model: CausalLM, slices: dict[str, WeightSlice]) -> dict:
        return lora_slices(model, slices)

    def apply(self, model: CausalLM) -> None:
        split_stages(model, self.groups)
        apply_tensor_parallel(model, self.groups.tp, vocab_parallel=self.layout.vocab_parallel)
        if not self.layout.computes_logits:
            drop_head(model)


@dataclass(frozen=True)
class DryRunRank:
    """Rank `rank` of `size`, for splitting a model without processes: no collective is ever called."""

    size: int
    rank: int = 0
    device: torch.device = torch.device("meta")


def check_split(config: EngineConfig) -> None:
    """Split a meta-device copy of `config.model` as rank 0 will, so a split the model
    cannot take (heads, features or layers that do not divide, an architecture
    without shards) is refused, with the sizes that work, before any process starts."""
    from kvforge.models.loader import load_config, resolve_model_dir
    from kvforge.models.meta_build import on_meta
    from kvforge.models.registry import model_class

    model_config = load_config(resolve_model_dir(config.model))
    with on_meta():
        model = model_class(model_config.get("architectures") or [])(model_config)
        part = RankPart(dry_run_groups(config))
        take_slices(model, part.weight_slices(model))
        model.finish_loading()
        part.apply(model)


def dry_run_groups(config: EngineConfig, rank: int = 0) -> RankGroups:
    """Rank `rank`'s groups, without processes: for splitting a model (meta-device, or
    loaded in one process to see what a rank reads) where no collective is called."""
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    layout = RankLayout(tp, parallel.pipeline_parallel_size, rank, parallel.vocab_parallel and tp > 1)
    world = DryRunRank(parallel.world_size, rank)
    return RankGroups(layout, world, DryRunRank(tp, layout.tp_rank) if tp > 1 else SoloGroup(world.device))


def load_worker_shard(spec: WorkerSpec, groups: RankGroups) -> CausalLM:
    """A worker's shard, its implementations resolved by name as the driver's were."""
    config = spec.engine_config
    plugins = config.plugins
    registry = build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict)
    backend = registry.select(ATTENTION_BACKEND, spec.attention_backend).cls
    dtype = components.resolve_dtype(config, groups.world.device)
    return load_shard(config, groups, dtype, backend, components.resolve_kv_quantizer(registry, config),
                      components.weight_quantizer(registry, config))
