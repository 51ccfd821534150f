"""One step on one rank, driver or worker: its part of the forward, then the logits.

Every rank runs its model part (`model.forward`: its layers, meeting the others
in all-reduces and stage hand-offs). Ranks of stage 0 that compute logits
(`RankLayout.computes_logits`) then, under pipeline parallelism, receive the
final hidden states from the same tensor-parallel place of the last stage, and
compute the logits of the step's sampled rows: the whole vocabulary on rank 0
with a replicated head, or each rank its vocabulary slice, gathered.

A model that `computes_output_rows_only` runs its last layer on the sampled rows
alone (models/output_rows.py) on the ranks of the last stage, which hold that
layer; they then send stage 0 those rows' hidden states only. Every rank knows
the rows, so stage 0 knows what to receive. Under pipeline parallelism a step
that samples nothing keeps the full path, so no stage sends an empty tensor.
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
        self.last_stage = layout.last_stage
        self.rows_only_model = getattr(model, "computes_output_rows_only", False)
        self.stages = layout.pp

    def rows_only(self, rows: torch.Tensor, tokens: int) -> bool:
        """Whether the last stage runs its last layer on the step's sampled `rows` only
        (and returns, or sends to stage 0, their hidden states alone): the same answer
        on every rank."""
        return self.rows_only_model and rows.numel() < tokens and (rows.numel() > 0 or self.stages == 1)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            batch: AttentionBatch, rows: torch.Tensor, token_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """`token_slots`: each token's LoRA slot (-1: the base model), None when no token has an adapter."""
        model = self.model
        tokens = input_ids.shape[0]
        rows_only = self.rows_only(rows, tokens)
        output_rows = rows if rows_only and self.last_stage else None
        plan = model.plan(batch) if output_rows is None else model.plan(batch, output_rows.to(input_ids.device))
        lora = getattr(model, "lora", None)
        if lora is not None:
            lora.set_step(token_slots, output_rows)
        hidden = model.forward(input_ids, positions, kv_caches, plan)
        if not self.computes_logits:
            return None
        if self.final_from is not None:  # this stage-0 rank ran the first layers; the last stage sends the end
            count = rows.numel() if rows_only else tokens
            hidden = self.groups.world.recv(hidden.new_empty((count, hidden.shape[-1])), self.final_from)
        if rows.numel() == 0:  # every rank knows: no gather of empty slices
            return hidden.new_zeros((0, model.vocab_size), dtype=torch.float32) if self.returns else None
        logits = model.compute_logits(hidden if rows_only else hidden[rows.to(hidden.device)]).float()
        if self.gathers:
            logits = gather_logits(logits, self.groups.tp, model.vocab_size)
        return logits if self.returns else None
