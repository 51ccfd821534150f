"""The inputs of a decode step (one known token per request, plus the draft
tokens it verifies, if any), written into buffers kept across steps.

Most steps of a running engine are decodes, and at a small batch their inputs
are a handful of integers per request. Building fresh tensors for them costs
one torch call each, and right after the model's forward (which has swept the
CPU's caches) every call is slow: a step verifying drafts at batch 1 spent
longer building its inputs with tensor ops than a plain step spends outside its
forward. Here the integers are written into numpy arrays that share memory with
tensors made once: a step makes no tensor at all. A request's block-table row
is written only when its blocks differ from the row's previous content (a block
appended, a copy-on-write, another request in that row), compared as lists, so
a row is never stale.

The tensors handed out are views of these buffers: valid until the next
`DecodeInputs.build` or `advance` (the next pass of a multi-step burst, each
request one position on), which overwrites them in place.
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


def is_decode(scheduled: Sequence[ScheduledRequest]) -> bool:
    """One known token per request, then its drafts if any: what `DecodeInputs.build` takes."""
    return all(entry.num_tokens == 1 + len(entry.draft_token_ids) for entry in scheduled)


class DecodeInputs:
    """Buffers for the inputs of decode steps of up to any batch size and draft count;
    they grow to the largest batch, token count and block table seen."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._rows = 0  # capacity of the per-request arrays
        self._views: dict[int, tuple] = {}  # batch size -> the per-request tensors
        self._tokens = 0  # capacity of the per-token arrays of steps with drafts
        self._draft_views: dict[tuple[int, int], tuple] = {}  # (batch, tokens) -> their tensors
        self._table = np.zeros(0, dtype=np.int32)  # flat block table, laid out [batch, width]
        self._table_tensor = torch.from_numpy(self._table)
        self._table_shape = (0, 0)
        self._table_view: torch.Tensor | None = None
        self._table_rows: list[list[int] | None] = []  # each row's content as last written
        self._last: tuple | None = None  # (block tables, starts) of the last plain step, for `advance`

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

    def _grow_tokens(self, tokens: int) -> None:
        tokens = max(tokens, 2 * self._tokens, 8)
        # int64: input ids, positions, slots per token; int32: context lens, seq lens, query starts
        self._draft_int64 = np.zeros((3, tokens), dtype=np.int64)
        self._draft_int32 = np.zeros((3, tokens + 1), dtype=np.int32)  # a request has a token at least
        self._draft_int64_tensor = torch.from_numpy(self._draft_int64)
        self._draft_int32_tensor = torch.from_numpy(self._draft_int32)
        self._tokens = tokens
        self._draft_views = {}

    def _with_drafts(self, batch: int, num_tokens: int) -> tuple:
        views = self._draft_views.get((batch, num_tokens))
        if views is None:
            i64, i32 = self._draft_int64_tensor, self._draft_int32_tensor
            views = (i64[0, :num_tokens], i64[1, :num_tokens], i64[2, :num_tokens], i32[0, :batch],
                     i32[1, :batch], i32[2, :batch + 1])
            self._draft_views[(batch, num_tokens)] = views
        return views

    def build(self, scheduled: Sequence[ScheduledRequest], tables: Sequence[list[int]],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`(input_ids, positions, batch)` of a decode step (`is_decode`), `tables`
        being each request's block table; as `ModelRunner.build_batch`."""
        if any(entry.draft_token_ids for entry in scheduled):
            self._last = None
            return self._build_with_drafts(scheduled, tables, device)
        batch = len(scheduled)
        if batch > self._rows:
            self._grow(batch)
        starts = [entry.start for entry in scheduled]
        return self._plain([token_at(entry.request, start) for entry, start in zip(scheduled, starts)], starts,
                           tables, device)

    def advance(self, tokens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The inputs of the decode step after the last plain one (`build` without
        drafts, or `advance`): each request one position further on, fed its token
        in `tokens`, with the same block tables (which must hold that position)."""
        if self._last is None:
            raise ValueError("advance follows a plain decode step's build (one token per request, no drafts)")
        tables, starts = self._last
        if len(tokens) != len(starts):
            raise ValueError(f"advance takes one token per request of the last decode step ({len(starts)}), "
                             f"got {len(tokens)}")
        return self._plain(tokens, [start + 1 for start in starts], tables, device)

    def _plain(self, ids: Sequence[int], starts: list[int], tables: Sequence[list[int]],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """A plain decode step's inputs: request i fed `ids[i]` at position `starts[i]`."""
        batch, size = len(starts), self.block_size
        int64, int32 = self._int64, self._int32
        if batch == 1:  # scalar writes: no list to convert
            start = starts[0]
            int64[0, 0] = ids[0]
            int64[1, 0] = start
            int64[2, 0] = tables[0][start // size] * size + start % size
            int32[0, 0] = start
            int32[1, 0] = start + 1
        else:
            int64[0, :batch] = ids
            int64[1, :batch] = starts
            int64[2, :batch] = [t[s // size] * size + s % size for t, s in zip(tables, starts)]
            int32[0, :batch] = starts
            int32[1, :batch] = starts
            int32[1, :batch] += 1
        self._last = (tables, starts)
        return self._inputs(self._per_request(batch), tables, device, 1, max(starts) + 1)

    def _build_with_drafts(self, scheduled: Sequence[ScheduledRequest], tables: Sequence[list[int]],
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`build` for a step in which some requests verify drafts: each request's
        known token and its drafts are consecutive tokens from its `start`."""
        size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, ends, query_ends = [], [], []
        for entry, table in zip(scheduled, tables):
            start, end = entry.start, entry.start + entry.num_tokens
            ids.append(token_at(entry.request, start))
            ids += entry.draft_token_ids
            positions += range(start, end)
            slots += [table[p // size] * size + p % size for p in range(start, end)]
            starts.append(start)
            ends.append(end)
            query_ends.append(len(ids))
        batch, num_tokens = len(scheduled), len(ids)
        if num_tokens > self._tokens:  # batch <= num_tokens: the per-request arrays fit too
            self._grow_tokens(num_tokens)
        int64, int32 = self._draft_int64, self._draft_int32
        int64[0, :num_tokens] = ids
        int64[1, :num_tokens] = positions
        int64[2, :num_tokens] = slots
        int32[0, :batch] = starts
        int32[1, :batch] = ends
        int32[2, 1:batch + 1] = query_ends
        max_query_len = max(entry.num_tokens for entry in scheduled)
        return self._inputs(self._with_drafts(batch, num_tokens), tables, device, max_query_len, max(ends))

    def _inputs(self, views: tuple, tables: Sequence[list[int]], device: torch.device, max_query_len: int,
                max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`(input_ids, positions, batch)` from the step's buffer views (moved to `device`
        when it is not the CPU) and the block table."""
        input_ids, positions, slots, context_lens, seq_lens, query_start_loc = views
        block_table = self._block_table(tables)
        if device.type != "cpu":
            input_ids, positions, slots, context_lens, seq_lens, query_start_loc, block_table = (
                t.to(device) for t in (input_ids, positions, slots, context_lens, seq_lens, query_start_loc,
                                       block_table))
        attention = AttentionBatch(query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=context_lens,
                                   block_table=block_table, slot_mapping=slots, block_size=self.block_size,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
        return input_ids, positions, attention
