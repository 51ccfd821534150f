"""Which part of each checkpoint tensor a model shard keeps, read without the rest.

A rank of a tensor- or pipeline-parallel engine (`kvforge.distributed`) keeps
slices of its weights: a column-parallel layer some output rows, a row-parallel
one some input columns, an embedding some vocabulary rows, a pipeline stage only
its layers. `load_model(..., shard=...)` asks the shard for a `WeightSlice` per
parameter before reading, and reads only that part of each tensor from the
safetensors file (`safe_open(...).get_slice`), so a rank's host memory while
loading is about its shard, not the checkpoint. `take_slices` applies the same
slices to a model already in memory: one description, both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class WeightSlice:
    """The spans `[start, stop)` of dimension `dim` a shard keeps of one tensor, side by
    side in that order; no spans: the tensor is not read at all (another stage's)."""

    dim: int
    spans: tuple[tuple[int, int], ...]

    @property
    def skipped(self) -> bool:
        return not self.spans

    def cut(self, source) -> torch.Tensor:
        """The kept part of `source`: a tensor, or a safetensors slice (which reads only
        these spans from the file); always a new tensor."""
        index = (slice(None),) * self.dim
        parts = [source[(*index, slice(a, b))] for a, b in self.spans]
        if len(parts) == 1 and not isinstance(source, torch.Tensor):  # read from the file: already its own copy
            return parts[0]
        return torch.cat(parts, dim=self.dim)


SKIP = WeightSlice(0, ())


def rows(start: int, stop: int, *more: tuple[int, int]) -> WeightSlice:
    """Keep output rows (dimension 0) `[start, stop)`, then any further spans."""
    return WeightSlice(0, ((start, stop), *more))


class ModelShard(Protocol):
    """What `load_model` needs from a shard: its slices, asked on the model before its
    weights are in (q, k and v not fused yet), and `apply`, run once they are in (and
    fused), to turn the sliced layers into the shard's layers."""

    def weight_slices(self, model: nn.Module) -> dict[str, WeightSlice]: ...

    def apply(self, model: nn.Module) -> None: ...

    def lora_slices(self, model: nn.Module, slices: dict[str, WeightSlice]) -> dict:
        """Per checkpoint layer, how LoRA adapters are cut on this shard: `(slice of A,
        slice of B)` (None: that side whole), or None for a layer the shard does not hold
        (see `lora_layers.LoRAState.shard_slices`)."""
        ...


@torch.no_grad()
def take_slices(model: nn.Module, slices: dict[str, WeightSlice]) -> None:
    """Replace each named parameter of an in-memory `model` by its slice, in place: what
    loading with these slices would have read (skipped ones stay, for `apply` to drop)."""
    for name, part in slices.items():
        if part.skipped:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, nn.Parameter(part.cut(getattr(owner, attr)), requires_grad=False))
