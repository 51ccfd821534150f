"""KV memory waste: paged block tables versus contiguous max-length preallocation.

256 requests with prompt and output lengths drawn from long-tailed (log-normal)
distributions like those of chat traces (median prompt ~180 tokens, median
output ~140, capped at a 2048-token context) are admitted together and decoded
one token per step until each finishes. At every step we add up the slots
allocated and the slots holding a token; waste = 1 - used / allocated, summed
over the whole run.

* paged: the real `KVCacheManager` over the `nocache` allocator, for block sizes
  8, 16 and 32 (a request wastes at most one partly filled block).
* contiguous: every request reserves `max_model_len` slots up front, as an
  unpaged server must, since it cannot know the output length.

    pytest benchmarks/bench_kv_waste.py          # pytest-benchmark + the table
    python -m kvforge.benchmarks.bench_kv_waste  # the table alone
"""

from __future__ import annotations

import argparse

import numpy as np

from kvforge.core import BLOCK_ALLOCATOR, build_registry, cdiv
from kvforge.engine.kv_cache_manager import KVCacheManager

NUM_REQUESTS = 256
MAX_MODEL_LEN = 2048
BLOCK_SIZES = (8, 16, 32)


def workload(seed: int = 0, num_requests: int = NUM_REQUESTS) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths), each request fitting in MAX_MODEL_LEN."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(180), 1.0, num_requests), 4, MAX_MODEL_LEN // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(140), 0.9, num_requests), 1, MAX_MODEL_LEN - prompts).astype(int)
    return prompts, outputs


def paged_waste(block_size: int, prompts: np.ndarray, outputs: np.ndarray) -> float:
    """Waste of the real block tables, summed over every decode step."""
    allocator = build_registry().get(BLOCK_ALLOCATOR, "nocache").cls
    num_blocks = int(sum(cdiv(p + o, block_size) for p, o in zip(prompts, outputs)))
    kv = KVCacheManager(allocator(num_blocks, block_size), block_size, enable_prefix_caching=False)
    lengths = {}
    for index, prompt in enumerate(prompts):
        kv.admit(index, [0] * int(prompt))
        assert kv.allocate_slots(index, int(prompt) + 1)  # the prompt and the first sampled token
        lengths[index] = int(prompt) + 1
    allocated = used = 0
    while lengths:
        allocated += kv.usage().in_use * block_size
        used += sum(lengths.values())
        for index in list(lengths):
            if lengths[index] == prompts[index] + outputs[index]:
                kv.free(index)
                del lengths[index]
            else:
                lengths[index] += 1
                assert kv.allocate_slots(index, lengths[index])
    return 1 - used / allocated


def contiguous_waste(prompts: np.ndarray, outputs: np.ndarray) -> float:
    """Waste when each request holds MAX_MODEL_LEN slots for its whole life."""
    steps = outputs  # a request lives one step per output token, holding prompt + 1 .. prompt + output tokens
    used = sum(int(s) * int(p) + int(s) * (int(s) + 1) // 2 for p, s in zip(prompts, steps))
    return 1 - used / int(steps.sum() * MAX_MODEL_LEN)


def waste_table(seed: int = 0) -> list[tuple[str, str, float]]:
    prompts, outputs = workload(seed)
    rows = [("contiguous", f"max_len {MAX_MODEL_LEN}", contiguous_waste(prompts, outputs))]
    rows += [("paged", f"block {size}", paged_waste(size, prompts, outputs)) for size in BLOCK_SIZES]
    return rows


def format_table(rows: list[tuple[str, str, float]]) -> str:
    lines = [f"{'layout':<12} {'unit':<16} {'waste':>8}", "-" * 38]
    lines += [f"{layout:<12} {unit:<16} {waste:>8.2%}" for layout, unit, waste in rows]
    return "\n".join(lines)


def test_kv_waste(benchmark):
    rows = benchmark.pedantic(waste_table, rounds=1, iterations=1)
    for layout, unit, waste in rows:
        benchmark.extra_info[f"{layout} {unit}"] = round(waste, 4)
    print("\n" + format_table(rows))
    waste = {unit: w for _, unit, w in rows}
    assert waste["block 16"] < 0.04 < waste[f"max_len {MAX_MODEL_LEN}"]  # deterministic (seeded), not a timing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts, outputs = workload(args.seed)
    print(f"{NUM_REQUESTS} requests; prompt median {int(np.median(prompts))} (p99 {int(np.percentile(prompts, 99))}), "
          f"output median {int(np.median(outputs))} (p99 {int(np.percentile(outputs, 99))})")
    print(format_table(waste_table(args.seed)))


if __name__ == "__main__":
    main()
