"""Runs of one sequence through an attention backend in different company, for
`check_attention_batch_invariance` (guarantee 8 of `kvforge.core.AttentionBackend`).

A `Run` attends one sequence's queries, step by step over a chunking of them, at one
block size, with other sequences (their own random keys, values and queries) placed
before and after it in each step, and returns the sequence's output rows. A backend
declaring `batch_invariant` must give bitwise the same rows for every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvforge.core import AttentionBatch, AttentionLayerSpec, KVCacheSpec, cdiv


@dataclass(frozen=True)
class Sequence:
    """One sequence's keys and values `[L, kv_heads, d]` and queries `[L, heads, d]`."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor

    @classmethod
    def random(cls, layer: AttentionLayerSpec, length: int, dtype: torch.dtype, gen: torch.Generator) -> "Sequence":
        def draw(heads):
            return torch.randn(length, heads, layer.head_size, generator=gen).to(dtype)

        return cls(draw(layer.num_kv_heads), draw(layer.num_kv_heads), draw(layer.num_heads))

    def __len__(self) -> int:
        return int(self.keys.shape[0])


@dataclass(frozen=True)
class Run:
    """How the sequence is attended: `chunks` ((start, end) query rows per step, in
    order, covering all of it), `block_size`, and per step the other sequences as
    (context_len, query_len) with how many of them come before it."""

    chunks: list[tuple[int, int]]
    block_size: int
    others: list[list[tuple[int, int]]] = field(default_factory=list)
    before: list[int] = field(default_factory=list)
    seed: int = 0


def chunking(length: int, cuts: list[int]) -> list[tuple[int, int]]:
    """The query rows split at `cuts` (any integers; those outside 1..length-1 are dropped)."""
    points = [0, *sorted({c for c in cuts if 0 < c < length}), length]
    return list(zip(points, points[1:]))


def attend_run(cls: type, layer: AttentionLayerSpec, dtype: torch.dtype, device: str, seq: Sequence,
               run: Run) -> torch.Tensor:
    """The sequence's output rows `[L, heads, d]` (CPU) when attended as `run` says. Blocks
    are placed at random in the cache, and blocks no sequence uses hold NaN."""
    bs = run.block_size
    rng = random.Random(run.seed)
    gen = torch.Generator().manual_seed(run.seed)
    others = [[(ctx, q, Sequence.random(layer, ctx + q, dtype, gen)) for ctx, q in step]
              for step in (run.others or [[] for _ in run.chunks])]
    own_blocks = cdiv(len(seq), bs)
    most_other = max((sum(cdiv(ctx + q, bs) for ctx, q, _ in step) for step in others), default=0)
    num_blocks = own_blocks + most_other + 2
    spec = KVCacheSpec(bs, layer.num_kv_heads, layer.head_size, dtype)
    backend = cls(layer, spec, device)
    cache = torch.full(cls.kv_cache_shape(num_blocks, spec), float("nan"), dtype=spec.tensor_dtype, device=device)
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    own, pool = physical[:own_blocks], physical[own_blocks:]
    out = torch.full_like(seq.queries, float("nan"))
    for step, (start, end) in enumerate(run.chunks):
        company = others[step] if step < len(others) else []
        before = run.before[step] if step < len(run.before) else 0
        entries, free = [], list(pool)
        for ctx, q, other in company:  # (sequence, blocks, context, end): the others' blocks are fresh each step
            blocks = [free.pop() for _ in range(cdiv(ctx + q, bs))]
            entries.append((other, blocks, ctx, ctx + q))
        entries.insert(min(before, len(entries)), (seq, own, start, end))
        for other, blocks, ctx, stop in entries:
            if other is not seq:  # its context, as earlier steps would have written it
                write(backend, cache, other, blocks, 0, ctx, bs, device)
        rows = attend_step(backend, cache, entries, bs, device)
        at = [i for i, e in enumerate(entries) if e[0] is seq][0]
        offset = sum(stop - ctx for _, _, ctx, stop in entries[:at])
        out[start:end] = rows[offset:offset + end - start].cpu()
    return out


def write(backend, cache, seq: Sequence, blocks: list[int], begin: int, end: int, bs: int, device: str) -> None:
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(begin, end)], dtype=torch.int64)
    backend.write_kv(seq.keys[begin:end].to(device), seq.values[begin:end].to(device), cache, slots.to(device))


def attend_step(backend, cache, entries, bs: int, device: str) -> torch.Tensor:
    """One step over `entries` (sequence, blocks, context, end): write each one's new keys,
    plan, attend; the step's output rows in entry order."""
    width = max(len(blocks) for _, blocks, _, _ in entries)
    table = torch.zeros(len(entries), width, dtype=torch.int32)
    starts, seq_lens, ctx_lens, slots, queries = [0], [], [], [], []
    for i, (seq, blocks, ctx, stop) in enumerate(entries):
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        starts.append(starts[-1] + stop - ctx)
        seq_lens.append(stop)
        ctx_lens.append(ctx)
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx, stop)]
        queries.append(seq.queries[ctx:stop])
    keys = torch.cat([seq.keys[ctx:stop] for seq, _, ctx, stop in entries])
    values = torch.cat([seq.values[ctx:stop] for seq, _, ctx, stop in entries])
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    backend.write_kv(keys.to(device), values.to(device), cache, slot_mapping.to(device))
    batch = AttentionBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=slot_mapping.to(device), block_size=bs,
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])), max_seq_len=max(seq_lens))
    query = torch.cat(queries).to(device)
    out = torch.full_like(query, float("nan"))
    return backend.forward(query, cache, backend.plan(batch), out=out)


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Query rows whose outputs differ in any bit."""
    bits_a = a.contiguous().view(a.shape[0], -1).view(torch.uint8)
    bits_b = b.contiguous().view(b.shape[0], -1).view(torch.uint8)
    return (bits_a != bits_b).any(dim=1).nonzero().flatten().tolist()
