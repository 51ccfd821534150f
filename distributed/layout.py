"""Where each rank sits when tensor and pipeline parallelism combine, and its groups.

Ranks are laid out as vLLM lays them out: `rank = stage * tp + tp_rank`, so the
`tp` ranks of one pipeline stage are consecutive and rank 0 (the driver) is
tensor-parallel rank 0 of stage 0. Each stage's ranks form one tensor-parallel
group for the layers' all-reduces; hidden states cross a stage boundary point to
point, from tensor-parallel rank t of stage s to rank t of stage s + 1 (every
rank of a stage holds the same hidden states after its all-reduce, so each
sends its own copy: no broadcast inside the next stage). The last stage sends
the final hidden states back to stage 0, which holds the embedding and the LM
head. The step's plan is broadcast over the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .group import HOST, RankGroup


@dataclass(frozen=True)
class RankLayout:
    """Rank `rank` of `tp * pp`: its stage and its place in that stage's tensor-parallel
    group. `vocab_parallel`: the embedding and LM head are split over the tensor-parallel
    ranks (only meaningful when `tp > 1`)."""

    tp: int
    pp: int
    rank: int
    vocab_parallel: bool = False

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def computes_logits(self) -> bool:
        """Stage 0 holds the LM head: its rank 0 (which samples), and its other ranks too
        when the head is split by vocabulary."""
        return self.stage == 0 and (self.tp_rank == 0 or self.vocab_parallel)

    def at(self, rank: int) -> "RankLayout":
        """The layout of another rank of the same engine."""
        return replace(self, rank=rank)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The global rank of tensor-parallel rank `tp_rank` in `stage`."""
        return stage * self.tp + tp_rank


class SoloGroup:
    """A group of one rank (tensor parallelism off): nothing to reduce or gather."""

    rank, size, comm_seconds = 0, 1, 0.0

    def __init__(self, device: torch.device):
        self.device = device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def close(self) -> None:
        pass

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


@dataclass
class RankGroups:
    """A rank's place and its two groups: `world` (step broadcasts, stage hand-offs by
    global rank, reports) and `tp` (its stage's all-reduces; `world` itself without
    pipeline stages, a `SoloGroup` without tensor parallelism)."""

    layout: RankLayout
    world: RankGroup
    tp: RankGroup | SoloGroup

    @property
    def groups(self) -> list:
        """The distinct groups, for failure handlers and communication clocks."""
        return [self.world] if self.tp is self.world else [self.world, self.tp]

    @property
    def comm_seconds(self) -> float:
        return sum(g.comm_seconds for g in self.groups)

    def close(self) -> None:
        """Release every group's threads and sockets (see `RankGroup.close`)."""
        for group in self.groups:
            group.close()


def build_groups(store: dist.Store, rank: int, parallel, device: torch.device, host: str = HOST) -> RankGroups:
    """This rank's groups for `parallel` (a `ParallelConfig`), met through `store`, its
    sockets bound to `host`; every rank calls it together."""
    tp, pp, timeout_s = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.collective_timeout_s
    layout = RankLayout(tp, pp, rank, parallel.vocab_parallel and tp > 1)
    world = RankGroup(store, rank, tp * pp, device, timeout_s, host)
    if tp == 1:
        tp_group = SoloGroup(world.device)
    elif pp == 1:
        tp_group = world
    else:  # one group per stage, each met under its own prefix of the one store
        tp_group = RankGroup(dist.PrefixStore(f"tp{layout.stage}/", store), layout.tp_rank, tp, device, timeout_s,
                             host)
    return RankGroups(layout, world, tp_group)
