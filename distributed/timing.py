"""Where each rank's step time goes: computing, or inside collectives.

Every rank times its model forward (`StageTimer`); the communication inside it
(all-reduces, or waiting for the previous pipeline stage) is told apart by the
group's `comm_seconds`. `gather_timings` collects every rank's figures on
request (the driver's `REPORT` command), for the pipeline's per-stage timing and
the tensor-parallel communication share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .group import RankGroup
from .layout import RankGroups


@dataclass
class RankTiming:
    """One rank's totals since it started: forward passes, the compute inside them,
    and all time inside collectives (step broadcasts included)."""

    forward_seconds: float
    compute_seconds: float
    comm_seconds: float


class StageTimer:
    """`with timer:` around a model forward adds to its totals."""

    def __init__(self, group: RankGroup | RankGroups):
        self.group = group
        self.forward_seconds = 0.0
        self.comm_in_forward = 0.0

    def __enter__(self) -> "StageTimer":
        self._start, self._comm = time.perf_counter(), self.group.comm_seconds
        return self

    def __exit__(self, *exc) -> None:
        self.forward_seconds += time.perf_counter() - self._start
        self.comm_in_forward += self.group.comm_seconds - self._comm


def gather_timings(group: RankGroup, timer: StageTimer) -> list[RankTiming]:
    """Every rank's `RankTiming`, by rank, over the world `group`; every rank calls it
    together. Communication counts every group the timer watches."""
    mine = torch.tensor([timer.forward_seconds, timer.forward_seconds - timer.comm_in_forward,
                         timer.group.comm_seconds], dtype=torch.float64, device=group.device)
    return [RankTiming(*t.tolist()) for t in group.all_gather(mine)]
