"""Planted block allocators: the built-ins with one bug each, the bug in its docstring
(three of them the bugs a planted-bug run by a plugin author once slipped past the suite)."""

from __future__ import annotations

import os

from kvforge.plugins.block_allocators import NoCacheAllocator, PrefixCachingAllocator


class ForgetfulCopy(NoCacheAllocator):
    """copy_on_write keeps the caller's reference to the shared block."""

    name = "forgetful-copy"

    def copy_on_write(self, block_id):
        if self.ref_count(block_id) == 1:
            return block_id
        return self.allocate(1)[0]


class HeadFirst(PrefixCachingAllocator):
    """Evicts the head of a freed sequence first."""

    name = "head-first"

    def free(self, block_ids):
        super().free(list(block_ids)[::-1])


class ScanningAllocate(NoCacheAllocator):
    """Finds free blocks by scanning the whole pool."""

    name = "scanning"

    def allocate(self, count):
        found = [b for b in self.blocks if b.ref_count == 0][:count]
        if len(found) < count:
            return super().allocate(count)
        for block in found:
            self.free_queue.remove(block)
            block.ref_count = 1
        return [b.id for b in found]


class CountsOnlyHits(PrefixCachingAllocator):
    """`lookups` grows by the blocks found, not the blocks asked for: hit rate always 1.0."""

    name = "counts-only-hits"

    def lookup(self, block_hashes):
        found = super().lookup(block_hashes)
        self.lookups -= len(block_hashes) - len(found)
        return found


class EvictsCachedFirst(PrefixCachingAllocator):
    """Evicts the least recently used cached block while never-cached ones are free."""

    name = "evicts-cached-first"

    def _take(self):
        if self.cached_queue.size:
            block = self.cached_queue.popleft()
            del self.by_hash[block.hash]
            block.hash = None
            return block
        return self.free_queue.popleft()


class RandomRoot(PrefixCachingAllocator):
    """Chains every sequence to a root drawn at random per instance."""

    name = "random-root"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._root = os.urandom(32)


class IgnoresSeed(PrefixCachingAllocator):
    """Hashes as if every seed were 0."""

    name = "ignores-seed"

    def __init__(self, num_blocks, block_size, *, hash_algorithm="sha256", hash_seed=0):
        super().__init__(num_blocks, block_size, hash_algorithm=hash_algorithm, hash_seed=0)


class ResetsWhileHeld(PrefixCachingAllocator):
    """Clears the free cached blocks even while others are held."""

    name = "resets-while-held"

    def _refuse_reset_while_held(self):
        pass


class ResetKeepsIndex(PrefixCachingAllocator):
    """Clears every block's hash but keeps the hash -> block index."""

    name = "reset-keeps-index"

    def reset_prefix_cache(self):
        index = dict(self.by_hash)
        cleared = super().reset_prefix_cache()
        self.by_hash.update(index)
        return cleared


class ResetLeavesQueue(PrefixCachingAllocator):
    """Forgets the hashes but leaves their blocks in the cached queue."""

    name = "reset-leaves-queue"

    def reset_prefix_cache(self):
        self._refuse_reset_while_held()
        for block in self.by_hash.values():
            block.hash = None
        cleared, self.by_hash = len(self.by_hash), {}
        return cleared


PLANTED = [
    ForgetfulCopy, HeadFirst, ScanningAllocate, CountsOnlyHits, EvictsCachedFirst, RandomRoot, IgnoresSeed,
    ResetsWhileHeld, ResetKeepsIndex, ResetLeavesQueue,
]
