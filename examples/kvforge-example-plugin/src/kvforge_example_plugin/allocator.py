"""`free-stack`: a block allocator without prefix caching, in thirty lines of logic."""

from collections import Counter
from collections.abc import Sequence

from kvforge.core import AllocatorUsage, BlockAllocator, BlockStateError, OutOfBlocksError


class FreeStackAllocator(BlockAllocator):
    """Free blocks on a stack, a reference count per block.

    The stack makes allocate and free O(1) per block (guarantee 6), and the most
    recently freed block is handed out first, which keeps the working set of
    blocks small. Without prefix caching it keeps the interface's defaults for
    hashing, lookup and `reset_prefix_cache`; select it with
    `cache.enable_prefix_caching = false`."""

    name = "free-stack"
    api_version = (1, 4)
    supports_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int, **hashing):
        super().__init__(num_blocks, block_size, **hashing)
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # block 0 on top: handed out first

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"block allocator {self.name!r}: cannot allocate {count} blocks; ask for 0 or more")
        if count > len(self._free):
            raise OutOfBlocksError(f"block allocator {self.name!r}: {count} blocks asked, {len(self._free)} of "
                                   f"{self.num_blocks} free; free some blocks or configure more")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        self._check_held(block_ids, "free")
        for block in block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        self._check_held(list(dict.fromkeys(block_ids)), "fork")  # forking a block twice in one call is fine
        for block in block_ids:
            self._refs[block] += 1
        return list(block_ids)

    def copy_on_write(self, block_id: int) -> int:
        self._check_held([block_id], "copy on write")
        if self._refs[block_id] == 1:
            return block_id
        (fresh,) = self.allocate(1)  # raises, changing nothing, when none is free
        self._refs[block_id] -= 1
        return fresh

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def usage(self) -> AllocatorUsage:
        free = len(self._free)
        return AllocatorUsage(self.num_blocks, free, cached=0, in_use=self.num_blocks - free, lookups=0, hits=0)

    def _check_held(self, block_ids: Sequence[int], action: str) -> None:
        """Refuse, before changing anything, a call that names a block out of range or
        more often than it has holders (guarantee 3)."""
        for block, times in Counter(block_ids).items():
            if not 0 <= block < self.num_blocks:
                raise BlockStateError(f"block allocator {self.name!r} cannot {action} block {block}: ids run "
                                      f"0..{self.num_blocks - 1}; nothing was changed")
            if times > self._refs[block]:
                raise BlockStateError(f"block allocator {self.name!r} cannot {action} block {block}: it has "
                                      f"{self._refs[block]} holder(s), asked {times} time(s); nothing was changed")
