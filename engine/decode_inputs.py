"""The inputs of a pure-decode step (one known token per request), written into
buffers kept across steps.

Most steps of a running engine are pure decodes, and at a small batch their
inputs are a handful of integers per request. Building fresh tensors for them
costs one torch call each, and right after the model's forward (which has
swept the CPU's caches) every call is slow. Here the integers are written into
numpy arrays that share memory with tensors made once: a step makes no tensor
at all. A request's block-table row is written only when its blocks differ
from the row's previous content (a block appended, a copy-on-write, another
request in that row), compared as lists, so a row is never stale.

The tensors handed out are views of these buffers: valid until the next
`DecodeInputs.build`, which overwrites them in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvforge.core import AttentionBatch

from .scheduler_output import ScheduledRequest


def token_at(request, position: int) -> int:
    """The known token of `request` at `position` (prompt, then output)."""
    prompt = request.prompt_token_ids
    return prompt[position] if position < len(prompt) else request.output_token_ids[position - len(prompt)]


def is_pure_decode(scheduled: Sequence[ScheduledRequest]) -> bool:
    """One known token per request and no drafts: what `DecodeInputs.build` takes."""
    return all(entry.num_tokens == 1 and not entry.draft_token_ids for entry in scheduled)


class DecodeInputs:
    """Buffers for the inputs of pure-decode steps of up to any batch size; they grow
    to the largest batch and block table seen."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._rows = 0  # capacity of the per-request arrays
        self._views: dict[int, tuple] = {}  # batch size -> the per-request tensors
        self._table = np.zeros(0, dtype=np.int32)  # flat block table, laid out [batch, width]
        self._table_tensor = torch.from_numpy(self._table)
        self._table_shape = (0, 0)
        self._table_view: torch.Tensor | None = None
        self._table_rows: list[list[int] | None] = []  # each row's content as last written

    def _grow(self, rows: int) -> None:
        rows = max(rows, 2 * self._rows, 8)
        # int64: input ids, positions, slots; int32: context lens, seq lens, query starts 0..rows
        self._int64 = np.zeros((3, rows), dtype=np.int64)
        self._int32 = np.zeros((3, rows + 1), dtype=np.int32)
        self._int32[2] = np.arange(rows + 1, dtype=np.int32)
        self._int64_tensor = torch.from_numpy(self._int64)
        self._int32_tensor = torch.from_numpy(self._int32)
        self._rows = rows
        self._views = {}

    def _per_request(self, batch: int) -> tuple:
        views = self._views.get(batch)
        if views is None:
            i64, i32 = self._int64_tensor, self._int32_tensor
            views = (i64[0, :batch], i64[1, :batch], i64[2, :batch], i32[0, :batch], i32[1, :batch],
                     i32[2, :batch + 1])
            self._views[batch] = views
        return views

    def _block_table(self, tables: Sequence[list[int]]) -> torch.Tensor:
        """int32 `[batch, width]`, contiguous, zero past each row's blocks; rows rewritten
        only where their blocks changed."""
        shape = (len(tables), max(map(len, tables)))
        if shape != self._table_shape:  # a new layout: every row is written again
            size = shape[0] * shape[1]
            if size > self._table.size:
                self._table = np.zeros(max(size, 2 * self._table.size), dtype=np.int32)
                self._table_tensor = torch.from_numpy(self._table)
            self._table_shape = shape
            self._table_view = self._table_tensor[:size].view(shape)
            self._table_rows = [None] * shape[0]
        table = self._table[:shape[0] * shape[1]].reshape(shape)
        previous = self._table_rows
        for row, blocks in enumerate(tables):
            if blocks != previous[row]:
                table[row, :len(blocks)] = blocks
                table[row, len(blocks):] = 0
                previous[row] = blocks[:]  # a copy: the manager changes its lists in place
        return self._table_view

    def build(self, scheduled: Sequence[ScheduledRequest], tables: Sequence[list[int]],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`(input_ids, positions, batch)` of a pure-decode step (`is_pure_decode`),
        `tables` being each request's block table; as `ModelRunner.build_batch`."""
        batch = len(scheduled)
        if batch > self._rows:
            self._grow(batch)
        size = self.block_size
        starts = [entry.start for entry in scheduled]
        int64, int32 = self._int64, self._int32
        if batch == 1:  # scalar writes: no list to convert
            start = starts[0]
            int64[0, 0] = token_at(scheduled[0].request, start)
            int64[1, 0] = start
            int64[2, 0] = tables[0][start // size] * size + start % size
            int32[0, 0] = start
            int32[1, 0] = start + 1
        else:
            int64[0, :batch] = [token_at(entry.request, entry.start) for entry in scheduled]
            int64[1, :batch] = starts
            int64[2, :batch] = [t[s // size] * size + s % size for t, s in zip(tables, starts)]
            int32[0, :batch] = starts
            int32[1, :batch] = starts
            int32[1, :batch] += 1
        input_ids, positions, slots, context_lens, seq_lens, query_start_loc = self._per_request(batch)
        block_table = self._block_table(tables)
        if device.type != "cpu":
            input_ids, positions, slots, context_lens, seq_lens, query_start_loc, block_table = (
                t.to(device) for t in (input_ids, positions, slots, context_lens, seq_lens, query_start_loc,
                                       block_table))
        attention = AttentionBatch(query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=context_lens,
                                   block_table=block_table, slot_mapping=slots, block_size=size, max_query_len=1,
                                   max_seq_len=max(starts) + 1)
        return input_ids, positions, attention
