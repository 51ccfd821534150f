"""CPU weights and KV caches on 2 MiB pages.

A CPU decode step streams every weight from memory, and the attention reads
KV blocks at scattered places. On 4 KiB pages that is a TLB miss every 4 KiB
(under a hypervisor, a nested page walk), and a miss the prefetchers stop at:
the hardware's stream prefetchers do not cross a page, and the linear kernels'
prefetches of the next tile (kernels/linear.cpp, `Lookahead`) mostly went
unused until the weights sat on 2 MiB pages. Measured effects: docs/models.md,
"Weights on 2 MiB pages".

`on_huge_pages` copies tensors side by side into one anonymous mapping that
the kernel is asked (`madvise(MADV_HUGEPAGE)`) to back with transparent huge
pages; `zeros_on_huge_pages` makes zeroed tensors there. Where that advice
does not exist (not Linux) they return the tensors as they were. Whether the
kernel grants the pages is the system's setting
(`/sys/kernel/mm/transparent_hugepage/enabled`: `always` or `madvise` does,
`never` does not); the tensors work the same either way.
"""

from __future__ import annotations

import mmap

import torch

from kvforge.core import cdiv

from .heap import release_free_memory

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each tensor starts on a cache line


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` zeroed bytes starting on a 2 MiB boundary, advised onto huge pages;
    None where the advice does not exist. The tensor keeps the mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous (shared would be shmem)
    region.madvise(advice)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Cache-line-aligned offsets of blocks of `sizes` bytes laid side by side, and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += cdiv(size, ALIGN) * ALIGN
    return offsets, total


def _views(arena: torch.Tensor, offsets: list[int], shapes: list[torch.Size],
           dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Tensors of `shapes` and `dtypes` over `arena`'s bytes from `offsets`."""
    return [arena[o:o + s.numel() * d.itemsize].view(d).view(s) for o, s, d in zip(offsets, shapes, dtypes)]


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, side by side in one huge-page mapping
    in the order given (the order a step reads them); the tensors themselves
    when any is not on the CPU or there is no such mapping here."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return tensors
    views = _arena_views(tensors)
    if views is None:
        return tensors
    for view, tensor in zip(views, tensors):
        view.copy_(tensor)
    return views


def move_onto_huge_pages(holders: list, name: str) -> None:
    """Replace the CPU tensor each of `holders` keeps as attribute `name` by a copy
    side by side in one huge-page mapping, in the order given (as `on_huge_pages`),
    one at a time: each tensor the move frees goes back to the OS before the next
    is copied (`heap.release_free_memory`), so a model's weights are never held
    twice over. Nothing moves when one is not on the CPU or there is no such
    mapping here. The holders must be the tensors' only owners for that."""
    views = _arena_views([getattr(holder, name) for holder in holders])
    if views is None:
        return
    for holder, view in zip(holders, views):
        view.copy_(getattr(holder, name))
        setattr(holder, name, view)
        release_free_memory()


def _arena_views(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Empty views for `tensors`' copies, side by side in one new huge-page mapping;
    None when there are none, one is not on the CPU, or there is no such mapping."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    offsets, total = _layout([t.nbytes for t in tensors])
    arena = huge_page_bytes(total)
    if arena is None:
        return None
    return _views(arena, offsets, [t.shape for t in tensors], [t.dtype for t in tensors])


def zeros_on_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Zeroed CPU tensors of `shapes`, side by side in one huge-page mapping; None
    where there is no such mapping here."""
    sizes = [torch.Size(s).numel() * dtype.itemsize for s in shapes]
    offsets, total = _layout(sizes)
    arena = huge_page_bytes(total)
    if arena is None:
        return None
    arena.zero_()  # fault every page in now, as torch.zeros does, not in the steps that first write there
    return _views(arena, offsets, [torch.Size(s) for s in shapes], [dtype] * len(shapes))
