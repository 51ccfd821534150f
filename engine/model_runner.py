"""Turn one scheduler step into one model call.

The scheduled requests' new tokens are flattened into a single ragged batch
(no padding); positions, `query_start_loc`, `seq_lens` and the slot mapping are
computed with tensor ops from the per-request lengths and the block table, so
no Python loop runs over tokens. `plan` is called once per step; logits are
computed only for the rows that are sampled: a sampling request's last known
token and each of its draft tokens (speculative decoding verifies them all in
this one forward pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.core import AttentionBatch

from .scheduler import ScheduledRequest


class ModelRunner:
    """Owns the per-layer KV caches of one model."""

    def __init__(self, model, kv, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)

    def build_batch(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`(input_ids, positions, batch)` for the scheduled requests, in order."""
        tokens: list[int] = []
        for entry in scheduled:
            known_end = entry.start + entry.num_tokens - len(entry.draft_token_ids)
            tokens += token_slice(entry.request, entry.start, known_end)
            tokens += entry.draft_token_ids
        starts = [entry.start for entry in scheduled]
        lens = [entry.num_tokens for entry in scheduled]
        device = self.device
        query_lens = torch.tensor(lens, dtype=torch.int32)
        context_lens = torch.tensor(starts, dtype=torch.int32)
        query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        seq_lens = context_lens + query_lens
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), query_lens.long())
        positions = (torch.arange(len(tokens)) - query_start_loc[:-1].long()[seq_of_token]
                     + context_lens.long()[seq_of_token])
        block_table = self.kv.block_table_tensor([entry.request.request_id for entry in scheduled]).to(torch.int32)
        slot_mapping = (block_table[seq_of_token, positions // self.block_size].long() * self.block_size
                        + positions % self.block_size)
        batch = AttentionBatch(
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens.to(device),
            context_lens=context_lens.to(device),
            block_table=block_table.to(device),
            slot_mapping=slot_mapping.to(device),
            block_size=self.block_size,
            max_query_len=max(lens),
            max_seq_len=max(s + n for s, n in zip(starts, lens)),
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        return input_ids, positions.to(device), batch

    def apply_block_copies(self) -> int:
        """Copy-on-write: copy each pending (src, dst) block in every layer's cache."""
        copies = self.kv.pop_pending_copies()
        copy_blocks(self.kv_caches, copies, self.device)
        return len(copies)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The model's hidden states for one step's batch: `plan` once, then `forward`."""
        plan = self.model.plan(batch)
        return self.model.forward(input_ids, positions, self.kv_caches, plan)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Run one step; float32 logits of the last `entry.num_logit_rows` new tokens
        of every scheduled entry, entry after entry: `[sum of num_logit_rows, vocab]`."""
        self.apply_block_copies()
        input_ids, positions, batch = self.build_batch(scheduled)
        hidden = self.forward(input_ids, positions, batch)
        rows = logit_rows(scheduled)
        if rows.numel() == 0:
            return hidden.new_zeros((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[rows.to(hidden.device)]).float()


def logit_rows(scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
    """The rows of a step's flattened tokens whose logits are sampled: the last
    `entry.num_logit_rows` new tokens of every entry, entry after entry (int64, CPU)."""
    counts = torch.tensor([entry.num_logit_rows for entry in scheduled], dtype=torch.int64)
    total = int(counts.sum())
    # Row r of an entry with c rows is its token (end - c + r): offsets within each entry by cumsum.
    ends = torch.cumsum(torch.tensor([entry.num_tokens for entry in scheduled], dtype=torch.int64), 0)
    first = torch.repeat_interleave(ends - counts, counts)
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return first + within


def copy_blocks(kv_caches: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]], device: torch.device) -> None:
    """Copy block `src` to block `dst` in every layer's cache, for each `(src, dst)`."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in kv_caches:
        cache[dst] = cache[src]


def token_slice(request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` without concatenating the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt): end - len(prompt)]
    return prompt[start:end] + output[: max(0, end - len(prompt))]
