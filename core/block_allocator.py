"""The `block_allocator` interface: a pool of fixed-size KV blocks.

A block id is an int in `range(num_blocks)`. A block is *free* when nobody holds
a reference to it. With prefix caching, a full block may also carry a content
hash; a free block that still carries its hash is *cached*: it can be handed back
to a new holder by `acquire` without recomputing its keys and values, until
`allocate` must evict it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .api import BLOCK_ALLOCATOR
from .errors import BlockStateError
from .implementation import Implementation, SelectionRequest

BlockHash = bytes


@dataclass(frozen=True)
class AllocatorUsage:
    """Usage figures. `free` counts every block with no holder, cached or not;
    `cached` the free blocks that still carry a hash and can be hit; `in_use` the
    blocks with a holder. `lookups` counts the blocks asked for by `lookup` and
    `hits` those of them found, both over the allocator's lifetime."""

    num_blocks: int
    free: int
    cached: int
    in_use: int
    lookups: int
    hits: int

    @property
    def hit_rate(self) -> float:
        """The share of looked-up blocks found; 0.0 before any lookup."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def usage(self) -> float:
        """The share of the pool that is held."""
        return self.in_use / self.num_blocks if self.num_blocks else 0.0


class BlockAllocator(Implementation):
    """A pool of `num_blocks` blocks of `block_size` token slots.

    Guarantees every implementation keeps (the conformance suite checks each):

      1. `allocate(n)` returns `n` distinct blocks that nobody held, each with
         reference count 1. If it cannot, it raises `OutOfBlocksError` and
         changes nothing.
      2. A block is never handed out by `allocate` while any holder has it.
      3. `free` drops one reference per listed block; a reference count never
         goes below zero: freeing a block nobody holds, or an id out of range,
         raises `BlockStateError` naming the block and leaves the pool unchanged.
      4. Once every holder has released every block, `usage().free == num_blocks`.
      5. `fork` adds a reference to each block; `copy_on_write` gives a holder of
         a shared block its own fresh block and drops its reference to the shared one.
      6. allocate, free, fork, acquire and lookup cost O(1) per block, whatever
         the pool size.

    With `supports_prefix_caching`:

      7. `hash_block` chains: the hash depends on the parent hash, the token ids
         and the extra keys (cache salt, model or adapter tag); different inputs
         give different hashes. It depends on nothing else but `hash_algorithm`
         and `hash_seed`: two allocators built with the same ones hash the same
         inputs identically, and with different seeds differently (no per-instance
         randomness, so a hash means the same content in every engine of a run).
      8. `lookup` returns the blocks of the longest prefix of the given hashes
         that are cached (held or free), and takes no references. It adds every
         hash it was given to `usage().lookups` and every block it returns to
         `usage().hits`, so `hit_rate` is the share of looked-up blocks found.
      9. A block whose reference count drops to zero keeps its hash and can be
         `acquire`d again until evicted. `allocate` evicts the least recently used
         cached free block first; among blocks released by one `free` call, the
         last listed (the tail of a sequence) is evicted first. Acquiring a cached
         block makes it the most recently used when it is freed again.
     10. A block handed out by `allocate` carries no hash.
     11. `allocate` evicts a cached block only when no never-cached free block
         is left: it hands out free blocks that carry no hash first, so exactly
         `max(0, n - never-cached free blocks)` cached blocks lose their hash.
     12. `reset_prefix_cache()` refuses with `BlockStateError`, changing nothing,
         while any block is held. Once every block is free it removes every hash:
         no block carries one, `lookup` finds nothing, `usage().cached == 0`, the
         same content can be cached again, and `lookups`/`hits` (lifetime totals)
         are unchanged. It returns how many cached blocks it cleared.
         Allocators written for API 1.0/1.1 predate it and inherit the default
         below; the check is skipped for those that cache.
    """

    kind: ClassVar[str] = BLOCK_ALLOCATOR
    supports_prefix_caching: ClassVar[bool] = False

    def __init__(self, num_blocks: int, block_size: int, *, hash_algorithm: str = "sha256", hash_seed: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.hash_seed = hash_seed

    @classmethod
    def unsupported_reasons(cls, request: SelectionRequest) -> list[str]:
        if request.prefix_caching and not cls.supports_prefix_caching:
            return ["does not support prefix caching"]
        return []

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"prefix_caching": cls.supports_prefix_caching}

    @abstractmethod
    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, each with reference count 1 and no hash."""

    @abstractmethod
    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Pass a sequence's blocks head first."""

    @abstractmethod
    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Share `block_ids` with a new holder: one more reference each; returns them."""

    @abstractmethod
    def copy_on_write(self, block_id: int) -> int:
        """Call before writing into `block_id`. Returns `block_id` if the caller is its
        only holder; otherwise a fresh block the caller must copy the content into."""

    @abstractmethod
    def ref_count(self, block_id: int) -> int:
        """How many holders `block_id` has."""

    @abstractmethod
    def usage(self) -> AllocatorUsage:
        """Current usage figures."""

    # Prefix caching. Allocators without it keep these defaults.

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> BlockHash:
        """The content hash of a full block, chained to its parent's hash."""
        raise NotImplementedError(f"block allocator {self.name!r} does not support prefix caching")

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest cached prefix of `block_hashes`; takes no references."""
        return []

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one reference to each cached block (held or free) found by `lookup`."""
        raise NotImplementedError(f"block allocator {self.name!r} does not support prefix caching")

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that held, full `block_id` has content `block_hash`. Returns False
        (and changes nothing) if another block already carries that hash."""
        return False

    def block_hash_of(self, block_id: int) -> BlockHash | None:
        """The hash `block_id` carries, if any."""
        return None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (guarantee 12); returns how many were cleared.

        Not abstract, so plugins written before it existed (API 1.0/1.1) still
        load. This default serves an allocator without prefix caching, which has
        nothing to clear; one that caches must override it, since only it knows
        where its hashes live, and until then a reset is refused here.
        """
        if self.supports_prefix_caching:
            raise NotImplementedError(
                f"block allocator {self.name!r} does not implement reset_prefix_cache (it was written before "
                f"kvforge added it); ask its author to add it, or choose cache.allocator=default")
        self._refuse_reset_while_held()
        return 0

    def _refuse_reset_while_held(self) -> None:
        """Raise the `BlockStateError` of guarantee 12 if any block is held."""
        in_use = self.usage().in_use
        if in_use:
            raise BlockStateError(f"cannot reset the prefix cache of block allocator {self.name!r}: {in_use} of "
                                  f"{self.num_blocks} blocks are held; free every block (finish or abort every "
                                  f"request) first")
