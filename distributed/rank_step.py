"""One step on one rank, driver or worker: its part of the forward, then the logits.

Every rank runs its model part (`model.forward`: its layers, meeting the others
in all-reduces and stage hand-offs). Ranks of stage 0 that compute logits
(`RankLayout.computes_logits`) then, under pipeline parallelism, receive the
final hidden states from the same tensor-parallel place of the last stage, and
compute the logits of the step's sampled rows: the whole vocabulary on rank 0
with a replicated head, or each rank its vocabulary slice, gathered.
"""

from __future__ import annotations

import torch

from kvforge.core import AttentionBatch

from .layout import RankGroups
from .vocab_parallel import gather_logits


class RankStep:
    """Runs `model` (this rank's part) for one step; `run` returns the full float32
    logits of the sampled rows on rank 0, and None on every other rank."""

    def __init__(self, model, groups: RankGroups):
        layout = groups.layout
        self.model, self.groups = model, groups
        self.computes_logits = layout.computes_logits
        self.final_from = layout.rank_of(layout.pp - 1, layout.tp_rank) if layout.pp > 1 else None
        self.gathers = layout.vocab_parallel
        self.returns = layout.rank == 0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            batch: AttentionBatch, rows: torch.Tensor) -> torch.Tensor | None:
        model = self.model
        hidden = model.forward(input_ids, positions, kv_caches, model.plan(batch))
        if not self.computes_logits:
            return None
        if self.final_from is not None:  # this stage-0 rank ran the first layers; the last stage sends the end
            hidden = self.groups.world.recv(torch.empty_like(hidden), self.final_from)
        if rows.numel() == 0:  # every rank knows: no gather of empty slices
            return hidden.new_zeros((0, model.vocab_size), dtype=torch.float32) if self.returns else None
        logits = model.compute_logits(hidden[rows.to(hidden.device)]).float()
        if self.gathers:
            logits = gather_logits(logits, self.groups.tp, model.vocab_size)
        return logits if self.returns else None
