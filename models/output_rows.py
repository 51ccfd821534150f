"""The attention batch of a step's output rows only, for a model's last layer.

A step needs hidden states only for the rows it samples from: the last new
token of each sequence that finishes its prompt or decodes (the last few when
drafts are verified), and none for a prompt chunk that ends mid-prompt. Every
layer but the last must still run on every token, since later layers read the
keys and values it writes; the last layer's keys and values are written for
every token too, but its attention output, output projection and MLP are only
needed for those rows. With a 2,048-token prefill chunk and one row to sample,
that spares nearly all of the last layer's work: a tenth of a 10-layer model's
prefill. `CausalLM.plan(batch, output_rows)` builds the last layer's plan over
`output_rows_batch`; see `ModelPlan.for_last_layer`.
"""

from __future__ import annotations

import torch

from kvforge.core import AttentionBatch


def output_rows_batch(batch: AttentionBatch, rows: torch.Tensor) -> AttentionBatch:
    """`batch` with only the query rows `rows` (increasing, each among the last new
    tokens of its sequence, as `ModelRunner` samples them); sequences with none
    drop out. Keys and values are unchanged: the cache holds all of them."""
    rows = rows.to(device=batch.query_start_loc.device, dtype=torch.int64)
    ends = batch.query_start_loc[1:].to(torch.int64)
    seq_of_row = torch.searchsorted(ends, rows, right=True)
    if rows.numel() and (int(rows[-1]) >= batch.num_tokens or int(rows[0]) < 0):
        raise ValueError(f"output rows must lie in 0..{batch.num_tokens - 1}, got {rows.tolist()}")
    counts = torch.bincount(seq_of_row, minlength=batch.num_seqs)
    expected = ends[seq_of_row] - (torch.cumsum(counts, 0)[seq_of_row] - torch.arange(rows.numel(), device=rows.device))
    if not torch.equal(rows, expected):
        raise ValueError(f"output rows must be the last new tokens of their sequences, in order, got {rows.tolist()} "
                         f"for sequences ending at rows {(ends - 1).tolist()}")
    keep = counts > 0
    kept = counts[keep].to(torch.int32)
    query_start_loc = torch.zeros(kept.numel() + 1, dtype=torch.int32, device=kept.device)
    torch.cumsum(kept, 0, out=query_start_loc[1:])
    seq_lens = batch.seq_lens[keep]
    return AttentionBatch(query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=seq_lens - kept,
                          block_table=batch.block_table[keep], slot_mapping=batch.slot_mapping[rows],
                          block_size=batch.block_size, max_query_len=int(kept.max()) if kept.numel() else 0,
                          max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0)
