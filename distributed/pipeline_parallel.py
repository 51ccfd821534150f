"""Pipeline parallelism of a loaded model: each rank keeps a stage of consecutive layers.

Stage s of P holds decoder layers `stage_layers(L, P, s)` and their KV cache.
The model's own `forward` runs unchanged on every stage; only its two ends are
swapped for the wire:
* on stages after the first, the token embedding becomes `ReceiveFromRank`,
  which returns the previous stage's hidden states instead of looking tokens up;
* on stages before the last, the final norm becomes `SendToRank` (to the next
  stage), and on the last stage the norm runs and its output goes to stage 0,
  which holds the embedding and LM head, computes the logits, and whose rank 0
  samples.

So a step is: rank 0 broadcasts the plan, then the hidden states walk
0 -> 1 -> ... -> P-1 -> 0. With tensor parallelism too, each stage is a
tensor-parallel group and the walk runs once per tensor-parallel place
(`layout.RankLayout`). Stages run one after another (no micro-batches),
so PP divides the weights and the KV cache, not the time: correct first.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import ConfigError
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.weight_slices import SKIP, WeightSlice

from .group import RankGroup
from .layout import RankGroups, RankLayout
from .vocab_parallel import drop_head


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: consecutive, as even as they divide. The first
    stages take the remainder, so no stage holds more layers than rank 0, whose KV
    spec sizes the block count every stage allocates."""
    if num_layers < stages:
        raise ConfigError(f"parallel.pipeline_parallel_size = {stages} is more than the model's {num_layers} "
                          f"layers; choose at most {num_layers}")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class ReceiveFromRank(nn.Module):
    """Stands in for the token embedding: the previous stage's hidden states, `[tokens, hidden]`."""

    weight = None  # a tied LM head reads the embedding's weight: this stage computes no logits

    def __init__(self, group: RankGroup, src: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.group, self.src, self.hidden_size, self.dtype = group, src, hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)
        return self.group.recv(x, self.src)


class SendToRank(nn.Module):
    """Stands in for (or follows) the final norm: sends its output to rank `dst` and returns it."""

    def __init__(self, group: RankGroup, dst: int, inner: nn.Module | None = None):
        super().__init__()
        self.group, self.dst, self.inner = group, dst, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (self.inner(x) if self.inner is not None else x).contiguous()
        self.group.send(out, self.dst)
        return out


def _check_family(model: nn.Module) -> None:
    if not isinstance(model, LlamaForCausalLM):
        raise ConfigError(f"pipeline parallelism supports the Llama family (Llama, Mistral, Qwen2, Qwen3), not "
                          f"{type(model).__name__}; set parallel.pipeline_parallel_size = 1 for this model")


def stage_slices(model: LlamaForCausalLM, layout: RankLayout) -> dict[str, WeightSlice]:
    """The weights this rank's stage never reads: other stages' layers, the embedding and
    an untied head after stage 0, the final norm before the last stage."""
    if layout.pp == 1:
        return {}
    _check_family(model)
    keep = stage_layers(len(model.layer_specs), layout.pp, layout.stage)
    skipped = {f"model.layers.{i}." for i in range(len(model.layer_specs)) if i not in keep}
    if layout.stage > 0:
        skipped |= {"model.embed_tokens.", "lm_head."}
    if not layout.last_stage:
        skipped.add("model.norm.")
    return {name: SKIP for name, _ in model.named_parameters() if name.startswith(tuple(skipped))}


def split_stages(model: LlamaForCausalLM, groups: RankGroups) -> None:
    """Keep this rank's stage of a Llama-family model, in place (the weights of other
    stages need not be loaded: `stage_slices`). Hidden states go from each rank to the
    rank of the same tensor-parallel place in the next stage; the last stage's final
    hidden states go back to those ranks of stage 0 that compute logits."""
    layout = groups.layout
    if layout.pp == 1:
        return
    _check_family(model)
    stage, stages, world = layout.stage, layout.pp, groups.world
    keep = stage_layers(len(model.layer_specs), stages, stage)
    inner = model.model
    inner.layers = nn.ModuleList(inner.layers[i] for i in keep)
    model.stage_layers = list(keep)  # local layer j is the checkpoint's layer keep[j] (LoRA adapters name those)
    model.layer_specs = [model.layer_specs[i] for i in keep]
    dtype = inner.layers[0].input_layernorm.weight.dtype  # loaded on every stage, unlike the embedding
    if stage > 0:
        inner.embed_tokens = ReceiveFromRank(world, layout.rank_of(stage - 1, layout.tp_rank),
                                             int(model.config["hidden_size"]), dtype)
        drop_head(model)  # only stage 0 computes logits
    if not layout.last_stage:
        inner.norm = SendToRank(world, layout.rank_of(stage + 1, layout.tp_rank))
    elif layout.at(layout.rank_of(0, layout.tp_rank)).computes_logits:
        inner.norm = SendToRank(world, layout.tp_rank, inner.norm)  # to the same place in stage 0
