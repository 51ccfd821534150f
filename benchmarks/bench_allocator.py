"""Block allocator throughput at 10^3 .. 10^6 blocks, for every registered allocator.

Each workload runs on a pool kept half held (a busy server), in batches of 64
blocks, and is reported as blocks per second:

* `alloc+free`: allocate a batch, free it.
* `fork+free`: share a held batch with a new holder, release it again.
* `hit+free` (prefix caching only): look a cached batch up, acquire it, free it.

    pytest benchmarks/bench_allocator.py               # pytest-benchmark, one row per case
    python -m kvforge.benchmarks.bench_allocator       # the table alone
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import pytest

from kvforge.core import BLOCK_ALLOCATOR, build_registry

SIZES = (10**3, 10**4, 10**5, 10**6)
BATCH = 64


@functools.lru_cache(maxsize=1)
def registry():
    return build_registry()


def allocators() -> list[type]:
    return [r.cls for r in registry().implementations(BLOCK_ALLOCATOR) if r.availability().ok]


def make_pool(cls, num_blocks: int):
    """A pool half held; with prefix caching, a cached batch sits among the free blocks."""
    pool = cls(num_blocks, 16)
    pool.allocate(num_blocks // 2)
    hashes = []
    if cls.supports_prefix_caching:
        blocks = pool.allocate(BATCH)
        hashes = [b"bench-%d" % block for block in blocks]
        for block, block_hash in zip(blocks, hashes):
            pool.cache_block(block, block_hash)
        pool.free(blocks)
    held = pool.allocate(BATCH)
    return pool, held, hashes


def alloc_free(pool, held, hashes):
    pool.free(pool.allocate(BATCH))


def fork_free(pool, held, hashes):
    pool.free(pool.fork(held))


def hit_free(pool, held, hashes):
    blocks = pool.lookup(hashes)
    pool.acquire(blocks)
    pool.free(blocks)


WORKLOADS = {"alloc+free": alloc_free, "fork+free": fork_free, "hit+free": hit_free}


def applies(cls, workload: str) -> bool:
    return workload != "hit+free" or cls.supports_prefix_caching


def blocks_per_second(cls, num_blocks: int, workload: str, rounds: int = 2000, repeats: int = 5) -> float:
    pool, held, hashes = make_pool(cls, num_blocks)
    run = WORKLOADS[workload]
    best = float("inf")
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(rounds):
                run(pool, held, hashes)
            best = min(best, time.perf_counter() - start)
    finally:
        gc.enable()
    return rounds * BATCH / best


CASES = [(cls, size, workload) for cls in allocators() for size in SIZES for workload in WORKLOADS
         if applies(cls, workload)]


@pytest.mark.parametrize("cls, size, workload", CASES, ids=[f"{c.name}-{s}-{w}" for c, s, w in CASES])
def test_allocator_throughput(benchmark, cls, size, workload):
    pool, held, hashes = make_pool(cls, size)
    run = WORKLOADS[workload]
    benchmark.extra_info["blocks_per_call"] = BATCH
    benchmark(run, pool, held, hashes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="batches per timing")
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    args = parser.parse_args(argv)
    header = f"{'allocator':<10} {'blocks':>9} " + " ".join(f"{w + ' /s':>14}" for w in WORKLOADS)
    print(header)
    print("-" * len(header))
    for cls in allocators():
        for size in args.sizes:
            cells = [f"{blocks_per_second(cls, size, w, args.rounds):>14,.0f}" if applies(cls, w) else f"{'-':>14}"
                     for w in WORKLOADS]
            print(f"{cls.name:<10} {size:>9,} " + " ".join(cells))


if __name__ == "__main__":
    main()
