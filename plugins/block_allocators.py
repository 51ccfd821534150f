"""Built-in block allocators: `default` (prefix caching) and `nocache`.

Both share the O(1) pool of `block_pool.py`. `default` keeps freed full blocks
cached in a second queue, least recently used at the head, so a later request
with the same prefix can `acquire` them instead of recomputing their keys and
values; `allocate` takes never-cached free blocks first and evicts cached ones
only when those run out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvforge.core import BlockHash, BlockStateError, hookimpl

from .block_hashing import available_algorithms, encode_block, make_hasher, root_hash
from .block_pool import Block, BlockPool, FreeQueue


class NoCacheAllocator(BlockPool):
    """The pool without prefix caching: a freed block forgets its content at once.
    The baseline for benchmarks, and the choice when prefix caching is off."""

    name = "nocache"
    priority = 0


class PrefixCachingAllocator(BlockPool):
    """The pool with content-hash prefix caching and LRU eviction."""

    name = "default"
    priority = 10  # `auto` picks it over `nocache`
    supports_prefix_caching = True

    def __init__(self, num_blocks: int, block_size: int, *, hash_algorithm: str = "sha256", hash_seed: int = 0):
        super().__init__(num_blocks, block_size, hash_algorithm=hash_algorithm, hash_seed=hash_seed)
        self._hasher = make_hasher(hash_algorithm)
        self._root = root_hash(self._hasher, hash_seed)
        self.cached_queue = FreeQueue()  # free blocks that carry a hash, least recently used first
        self.by_hash: dict[BlockHash, Block] = {}

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {**super().capabilities(), "hash_algorithms": available_algorithms()}

    # Where blocks come from and go to

    @property
    def num_free(self) -> int:
        return self.free_queue.size + self.cached_queue.size

    def _take(self) -> Block:
        if self.free_queue.size:
            return self.free_queue.popleft()
        block = self.cached_queue.popleft()  # evict the least recently used
        del self.by_hash[block.hash]
        block.hash = None
        return block

    def _release(self, block: Block) -> None:
        (self.cached_queue if block.hash is not None else self.free_queue).append(block)

    # Prefix caching

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> BlockHash:
        return self._hasher(encode_block(self._root if parent is None else parent, token_ids, extra_keys))

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        found = []
        for block_hash in block_hashes:
            block = self.by_hash.get(block_hash)
            if block is None:
                break
            found.append(block.id)
        self.lookups += len(block_hashes)
        self.hits += len(found)
        return found

    def acquire(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if self._block(block_id, "acquire").hash is None:
                raise BlockStateError(f"cannot acquire block {block_id}: it carries no hash (never cached, or "
                                      f"evicted since); acquire only blocks that lookup just returned")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.cached_queue.remove(block)
            block.ref_count += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        block = self._held(block_id, "cache")
        if block.hash == block_hash:
            return True
        if block_hash in self.by_hash:
            return False
        if block.hash is not None:
            raise BlockStateError(f"cannot cache block {block_id} under a new hash: it already carries another "
                                  f"one, and a full block's content never changes; cache each block once")
        block.hash = block_hash
        self.by_hash[block_hash] = block
        return True

    def block_hash_of(self, block_id: int) -> BlockHash | None:
        return self._block(block_id, "read the hash of").hash

    def reset_prefix_cache(self) -> int:
        # Refused while held: a held block's hash is what lets its holder's next
        # request hit it, and clearing only the free ones would half reset.
        self._refuse_reset_while_held()
        cleared = self.cached_queue.size
        while self.cached_queue.size:
            block = self.cached_queue.popleft()
            block.hash = None
            self.free_queue.append(block)
        self.by_hash.clear()
        return cleared


@hookimpl
def kvforge_implementations():
    return [PrefixCachingAllocator, NoCacheAllocator]
