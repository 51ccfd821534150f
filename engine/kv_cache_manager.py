"""Per-request block tables on top of a `BlockAllocator`.

A request's block table maps its logical blocks (token position // block_size)
to physical blocks. The manager grows tables as requests grow, shares blocks on
`fork` and copies a shared block before a request writes into it, and, with
prefix caching, hashes each full block so later requests with the same prefix
reuse it.

Positions: a request's next write starts at its *computed* length, which
`admit` sets to the prefix-cache hit and `cache_blocks` sets after each step;
before the first `cache_blocks` it is the high-water mark of `allocate_slots`;
`truncate` moves it back over rejected draft tokens. The scheduler keeps the
request's computed length (`Request.num_computed_tokens`) and passes it in; how
many tokens a request's blocks hold is read here (`capacity`), not kept twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.core import (AllocatorUsage, BlockAllocator, BlockHash, BlockStateError, PagedCSR, RequestError, cdiv,
                          paged_csr)


@dataclass
class _Request:
    extra_keys: tuple
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # where the next write starts
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks known so far
    num_cached: int = 0  # leading blocks already offered to the cache


class KVCacheManager:
    """Block tables for every live request, over one allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enable_prefix_caching: bool):
        if block_size != allocator.block_size:
            raise RequestError(f"the KV cache manager's block size {block_size} differs from the allocator's "
                               f"{allocator.block_size}; build both from cache.block_size")
        self.allocator = allocator
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and allocator.supports_prefix_caching
        self.requests: dict[str, _Request] = {}
        self._pending_copies: list[tuple[int, int]] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def _get(self, request_id: str, action: str) -> _Request:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"cannot {action} request {request_id!r}: it is not admitted (finished, aborted, "
                               f"preempted or never added); admit it first")
        return request

    # Admission and prefix hits

    def admit(self, request_id: str, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> int:
        """Register `request_id` and take its prefix-cache hits. Returns how many
        leading tokens are already computed: whole hit blocks, never the whole
        prompt, since the last prompt token must be recomputed for its logits."""
        if request_id in self.requests:
            raise RequestError(f"cannot admit request {request_id!r}: it is already admitted; free it first")
        request = _Request(extra_keys=tuple(extra_keys))
        if self.enable_prefix_caching and len(token_ids) > 1:
            self._extend_hashes(request, token_ids, (len(token_ids) - 1) // self.block_size)
            hits = self.allocator.lookup(request.hashes)
            self.allocator.acquire(hits)
            request.blocks = hits
            request.num_cached = len(hits)
            request.num_tokens = len(hits) * self.block_size
        self.requests[request_id] = request
        return request.num_tokens

    def _extend_hashes(self, request: _Request, token_ids: Sequence[int], num_full: int) -> None:
        """Chain `request.hashes` on until it covers the first `num_full` blocks."""
        hashes, size = request.hashes, self.block_size
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            hashes.append(self.allocator.hash_block(parent, token_ids[index * size:(index + 1) * size], request.extra_keys))

    # Growing

    def _blocks_to_copy(self, request: _Request, num_total_tokens: int) -> range:
        """Indices of existing blocks the next writes land in; shared ones need a copy."""
        first = request.num_tokens // self.block_size
        last = min(len(request.blocks), cdiv(num_total_tokens, self.block_size))
        return range(first, last)

    def _blocks_needed(self, request: _Request, num_total_tokens: int) -> tuple[int, list[int]]:
        new = max(0, cdiv(num_total_tokens, self.block_size) - len(request.blocks))
        shared = [i for i in self._blocks_to_copy(request, num_total_tokens)
                  if self.allocator.ref_count(request.blocks[i]) > 1]
        return new, shared

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        """Whether `allocate_slots(request_id, num_total_tokens)` would succeed now."""
        new, shared = self._blocks_needed(self._get(request_id, "allocate for"), num_total_tokens)
        return new + len(shared) <= self.num_free_blocks

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make room for `num_total_tokens` tokens: append blocks, and copy any shared
        block the new tokens will be written into (see `pop_pending_copies`).
        Returns False, changing nothing, when the pool has too few free blocks."""
        request = self._get(request_id, "allocate for")
        new, shared = self._blocks_needed(request, num_total_tokens)
        if new + len(shared) > self.num_free_blocks:
            return False
        request.blocks.extend(self.allocator.allocate(new))
        for index in shared:
            source = request.blocks[index]
            copy = self.allocator.copy_on_write(source)
            request.blocks[index] = copy
            if copy != source:
                self._pending_copies.append((source, copy))
        request.num_tokens = max(request.num_tokens, num_total_tokens)
        return True

    def pop_pending_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies made since the last call. The engine
        must apply them to every layer's cache before this step's keys are written."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # After a step

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record that the first `num_computed_tokens` of `token_ids` (the request's
        prompt and output so far) are in the cache, and offer every newly full
        block to the prefix cache under its chained hash."""
        request = self._get(request_id, "cache blocks of")
        if num_computed_tokens > len(request.blocks) * self.block_size:
            raise RequestError(f"request {request_id!r} reports {num_computed_tokens} computed tokens but holds "
                               f"room for {len(request.blocks) * self.block_size}; call allocate_slots first")
        request.num_tokens = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        if num_full <= request.num_cached:
            return
        self._extend_hashes(request, token_ids, num_full)
        for index in range(request.num_cached, num_full):
            # False means another block already holds this content; ours stays uncached.
            self.allocator.cache_block(request.blocks[index], request.hashes[index])
        request.num_cached = num_full

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Forget positions from `num_tokens` on (rejected draft tokens): blocks wholly
        past them return to the pool and the next write starts at `num_tokens`.
        Blocks already offered to the prefix cache are never given back here."""
        request = self._get(request_id, "truncate")
        if num_tokens < request.num_cached * self.block_size:
            raise RequestError(f"cannot truncate request {request_id!r} to {num_tokens} tokens: its first "
                               f"{request.num_cached * self.block_size} are in the prefix cache")
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(request.blocks):
            tail, request.blocks = request.blocks[keep:], request.blocks[:keep]
            self.allocator.free(tail)
        request.num_tokens = min(request.num_tokens, num_tokens)

    # Releasing and sharing

    def free(self, request_id: str) -> None:
        """Release every block of `request_id` (finish, abort or preemption); the
        allocator evicts its tail first. The request must be admitted again to run."""
        request = self._get(request_id, "free")
        try:
            self.allocator.free(request.blocks)
        except BlockStateError as exc:
            raise BlockStateError(f"request {request_id!r}: {exc}") from exc
        if self._pending_copies:  # preempted in the step that copied: its copies would land in freed blocks
            mine = set(request.blocks)
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst not in mine]
        del self.requests[request_id]

    def fork(self, parent_id: str, child_id: str) -> None:
        """Admit `child_id` sharing every block of `parent_id` (n > 1 sampling).
        The first write into a shared, partly filled block copies it."""
        parent = self._get(parent_id, "fork")
        if child_id in self.requests:
            raise RequestError(f"cannot fork request {parent_id!r} into {child_id!r}: {child_id!r} is already admitted")
        try:
            blocks = self.allocator.fork(parent.blocks)
        except BlockStateError as exc:
            raise BlockStateError(f"cannot fork request {parent_id!r}: {exc}") from exc
        self.requests[child_id] = _Request(parent.extra_keys, blocks, parent.num_tokens, list(parent.hashes),
                                           parent.num_cached)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, so later requests hit nothing computed before
        (benchmarks, or after swapping weights). Refused with `BlockStateError`
        while any request holds blocks. Returns how many cached blocks were cleared."""
        holding = [request_id for request_id, request in self.requests.items() if request.blocks]
        if holding:
            shown = ", ".join(repr(r) for r in holding[:3])
            if len(holding) > 3:
                shown += f" and {len(holding) - 3} more"
            raise BlockStateError(f"cannot reset the prefix cache while requests hold blocks ({shown}); let them "
                                  f"finish or abort them first")
        return self.allocator.reset_prefix_cache()

    # Views

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id, "read the block table of").blocks)

    def block_hashes(self, request_id: str, start: int, end: int) -> list[BlockHash]:
        """The prefix-cache hashes of the full blocks that tokens [start, end) of an
        admitted request complete, as far as they are known (none without prefix
        caching): what this request offers to the cache once they are computed."""
        hashes = self._get(request_id, "read the block hashes of").hashes
        return hashes[start // self.block_size: min(len(hashes), end // self.block_size)]

    def next_block_hash(self, request_id: str, num_computed_tokens: int) -> BlockHash | None:
        """The hash of the full block that starts at `num_computed_tokens`, if known."""
        hashes = self._get(request_id, "read the block hashes of").hashes
        index, offset = divmod(num_computed_tokens, self.block_size)
        return hashes[index] if offset == 0 and index < len(hashes) else None

    def live_block_tables(self, request_ids: Sequence[str]) -> list[list[int]]:
        """Each request's block table as the manager holds it, not a copy (the
        engine builds a step's tensors from them without copying every list):
        read them before the next change to the tables, and never modify them."""
        requests = self.requests
        try:
            return [requests[r].blocks for r in request_ids]
        except KeyError:
            missing = next(r for r in request_ids if r not in requests)
            self._get(missing, "read the block table of")
            raise

    def capacity(self, request_id: str) -> int:
        """Tokens the request's blocks have room for."""
        return len(self._get(request_id, "read").blocks) * self.block_size

    def num_tokens(self, request_id: str) -> int:
        """Where the request's next write starts (its computed or reserved length)."""
        return self._get(request_id, "read").num_tokens

    def block_table_tensor(self, request_ids: Sequence[str], device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 `[num_seqs, max_blocks]`, each row a block table padded with 0."""
        tables = [self._get(r, "read the block table of").blocks for r in request_ids]
        lengths = torch.tensor([len(t) for t in tables], dtype=torch.int64)
        width = int(lengths.max()) if tables else 0
        out = torch.zeros((len(tables), width), dtype=torch.int32)
        used = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        out[used] = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
        return out.to(device)

    def csr(self, request_ids: Sequence[str], seq_lens: Sequence[int] | torch.Tensor | None = None) -> PagedCSR:
        """The CSR view of `block_table_tensor(request_ids)` for `seq_lens` tokens
        (default: each request's `num_tokens`)."""
        if seq_lens is None:
            seq_lens = [self._get(r, "read").num_tokens for r in request_ids]
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
        return paged_csr(self.block_table_tensor(request_ids), seq_lens, self.block_size)

    def slot_mapping(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """int64 cache slots (`block * block_size + offset`) of positions [start, end)."""
        blocks = self._get(request_id, "map slots of").blocks
        if not 0 <= start <= end <= len(blocks) * self.block_size:
            raise RequestError(f"cannot map slots [{start}, {end}) of request {request_id!r}: it holds room for "
                               f"positions [0, {len(blocks) * self.block_size}); call allocate_slots first")
        first = start // self.block_size
        table = torch.tensor(blocks[first:cdiv(end, self.block_size)], dtype=torch.int64)
        positions = torch.arange(start, end, dtype=torch.int64)
        return table[positions // self.block_size - first] * self.block_size + positions % self.block_size

    # Figures

    def usage(self) -> AllocatorUsage:
        return self.allocator.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.usage().free
