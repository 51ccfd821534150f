"""Keep freed heap memory in the process, so each step's large activations are
reused instead of page-faulted in anew.

glibc returns large freed blocks to the OS (blocks above its mmap threshold are
unmapped; free space at the top of the heap is trimmed), so a CPU engine that
allocates the same multi-megabyte activations every step pays for fresh pages
every step (page-fault counts with and without this setting: docs/benchmarks.md,
"Memory allocator"). `keep_freed_memory()` raises both
thresholds with `mallopt` (the in-process form of `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_`). It is process-wide, so the engine config can turn it
off (`keep_freed_memory = false`); elsewhere than glibc it does nothing.

Memory freed while a model loads (a checkpoint tensor in the model's dtype
before it is packed or quantized, the float weight an int8 one replaces) is
never needed again, and with these thresholds it would stay in the process for
good: `release_free_memory()`, called once the model is in, returns every free
page of the heap to the OS (`malloc_trim`) before the steps' activations are
allocated and kept.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB of free heap top
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""The same settings as environment variables, for processes started from outside (benchmark peers)."""

_applied = False


def glibc():
    """The C library when it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are set."""
    global _applied
    if _applied:
        return True
    libc = glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); True when some were."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(libc.malloc_trim(0))
