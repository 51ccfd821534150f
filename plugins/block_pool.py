"""The block pool shared by the built-in allocators (a helper module, not a plugin).

Every block is one `Block` object created up front. Free blocks sit in
`FreeQueue`s: doubly linked lists threaded through the blocks themselves
(`prev`/`next`), so taking a block off either end, or out of the middle when a
cached block is hit again, is O(1) and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvforge.core import AllocatorUsage, BlockAllocator, BlockHash, BlockStateError, OutOfBlocksError


class Block:
    """One physical block: its holders, its content hash, and its free-list links."""

    __slots__ = ("id", "ref_count", "hash", "prev", "next")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: BlockHash | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.id}, ref_count={self.ref_count}, hash={'yes' if self.hash else 'no'})"


class FreeQueue:
    """A doubly linked list of free blocks; the head is taken first.

    A sentinel closes the ring, so no operation has an empty-list special case.
    """

    __slots__ = ("_sentinel", "size")

    def __init__(self, blocks: Sequence[Block] = ()):
        self._sentinel = Block(-1)
        self._sentinel.prev = self._sentinel.next = self._sentinel
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        """Put `block` at the tail (taken last)."""
        last = self._sentinel.prev
        block.prev, block.next = last, self._sentinel
        last.next = self._sentinel.prev = block
        self.size += 1

    def remove(self, block: Block) -> None:
        """Unlink `block`, wherever it sits."""
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        """Take the head block; the caller checks `size` first."""
        block = self._sentinel.next
        self.remove(block)
        return block

    def peek(self) -> Block | None:
        return self._sentinel.next if self.size else None

    def ids(self) -> list[int]:
        """Block ids head first (for tests and debugging; O(size))."""
        found, block = [], self._sentinel.next
        while block is not self._sentinel:
            found.append(block.id)
            block = block.next
        return found


class BlockPool(BlockAllocator):
    """Allocate, free, fork and copy-on-write over `num_blocks` blocks, no caching.

    Subclasses that cache override `_release` (where a freed block goes) and
    `_take` (which free block `allocate` hands out).
    """

    def __init__(self, num_blocks: int, block_size: int, *, hash_algorithm: str = "sha256", hash_seed: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise BlockStateError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and "
                                  f"{block_size}; check cache.num_blocks / cache.memory_budget and cache.block_size")
        super().__init__(num_blocks, block_size, hash_algorithm=hash_algorithm, hash_seed=hash_seed)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)  # free blocks that carry no hash
        self.lookups = 0
        self.hits = 0

    # The pool's state machine

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    def _take(self) -> Block:
        return self.free_queue.popleft()

    def _release(self, block: Block) -> None:
        self.free_queue.append(block)

    def _block(self, block_id: int, action: str) -> Block:
        if type(block_id) is not int and not hasattr(block_id, "__index__"):
            raise BlockStateError(f"cannot {action} block {block_id!r}: a block id is an int in range({self.num_blocks})")
        if not 0 <= block_id < self.num_blocks:
            raise BlockStateError(f"cannot {action} block {block_id}: out of range; valid block ids are "
                                  f"0..{self.num_blocks - 1}")
        return self.blocks[block_id]

    def _held(self, block_id: int, action: str) -> Block:
        block = self._block(block_id, action)
        if block.ref_count <= 0:
            raise BlockStateError(f"cannot {action} block {block_id}: nobody holds it (already freed, or never "
                                  f"allocated); pass only blocks returned by allocate, fork or acquire")
        return block

    # The interface

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise BlockStateError(f"cannot allocate {count} blocks: the count must be >= 0")
        if count > self.num_free:
            raise OutOfBlocksError(f"cannot allocate {count} blocks: only {self.num_free} of {self.num_blocks} "
                                   f"are free; free or preempt a request, or enlarge the cache")
        taken = []
        for _ in range(count):
            block = self._take()
            block.ref_count = 1
            taken.append(block.id)
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        # Drop the references first and undo them all if one is invalid, so a bad
        # call (also one naming a block twice) leaves the pool unchanged.
        done = 0
        try:
            for block_id in block_ids:
                self._held(block_id, "free").ref_count -= 1
                done += 1
        except BlockStateError:
            for block_id in block_ids[:done]:
                self.blocks[block_id].ref_count += 1
            raise
        # Release the tail first: the queue's head is evicted first, so a
        # sequence's last block (the longest hash chain, least likely to be hit
        # again) goes before its first.
        for index in range(len(block_ids) - 1, -1, -1):
            block = self.blocks[block_ids[index]]
            if block.ref_count == 0 and block.prev is None:
                self._release(block)

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        for block_id in block_ids:
            self._held(block_id, "fork")
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1
        return list(block_ids)

    def copy_on_write(self, block_id: int) -> int:
        block = self._held(block_id, "copy-on-write")
        if block.ref_count == 1:
            return block_id
        (fresh,) = self.allocate(1)
        block.ref_count -= 1
        return fresh

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id, "read the reference count of").ref_count

    def usage(self) -> AllocatorUsage:
        cached = self.num_free - self.free_queue.size
        return AllocatorUsage(num_blocks=self.num_blocks, free=self.num_free, cached=cached,
                              in_use=self.num_blocks - self.num_free, lookups=self.lookups, hits=self.hits)
