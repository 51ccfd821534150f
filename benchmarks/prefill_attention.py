"""Achieved GFLOP/s of the cpp backend's prefill attention against the GEMM peak
of this machine at the same thread count.

FLOPs convention: 4 * d per (query, key) pair a query sees, per query head (2 * d
for q.k and 2 * d for p.v), so a causal prompt of L tokens costs
2 * d * L * (L + 1) per head: the "4 * q * k * d" of a full square, halved by
causality. Masked pairs the kernel skips or computes count for nothing.

Each figure is the best of a few calls on fresh prompts (context 0, block size
16, shuffled blocks), every variant taking turns round by round, timed by this
process's CPU time at one thread (steadier on a crowded machine) and by elapsed
time at more; `before` is the
same call with KVFORGE_CPP_PREFILL=off
(the tiles older than the prefill tile), `sdpa` PyTorch's causal SDPA over the
same prompts held contiguously (vLLM's CPU prefill), and the GEMM peak the best
float32 n=1024 matmul of `torch.mm` and oneDNN's packed linear (machine.py's
kernels; the one the machine section takes as the peak is usually the latter).

    python -m kvforge.benchmarks.prefill_attention [--lengths 1024,2048] [--dtype float32,bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvforge.core import cdiv

from .machine import gemm_call, gemm_kernels


def prefill_flops(lengths: list[int], num_heads: int, head_size: int) -> float:
    """Useful FLOPs of causal prefill attention over fresh prompts of `lengths` (see the module doc)."""
    return float(sum(2 * head_size * n * (n + 1) for n in lengths) * num_heads)


def prefill_inputs(lengths: list[int], num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                   block_size: int = 16, seed: int = 0) -> dict:
    """The kernel's arguments for fresh prompts of `lengths`, every block shuffled in the cache."""
    g = torch.Generator().manual_seed(seed)
    needs = [cdiv(n, block_size) for n in lengths]
    num_blocks = sum(needs)
    physical = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(lengths), max(needs), dtype=torch.int32)
    used = 0
    for b, need in enumerate(needs):
        table[b, :need] = physical[used:used + need]
        used += need
    tokens = sum(lengths)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    query = torch.randn(tokens, num_heads, head_size, generator=g).to(dtype)
    return {"query": query, "kv_cache": cache, "query_start_loc": starts,
            "seq_lens": torch.tensor(lengths, dtype=torch.int32),
            "context_lens": torch.zeros(len(lengths), dtype=torch.int32), "block_table": table,
            "out": torch.empty_like(query)}


def prefill_call(inputs: dict, head_size: int, flag: str):
    """One paged_attention call over `inputs` with KVFORGE_CPP_PREFILL=`flag`, as a thunk."""
    args = (inputs["query"], inputs["kv_cache"], inputs["query_start_loc"], inputs["seq_lens"],
            inputs["context_lens"], inputs["block_table"], head_size ** -0.5, 0, 0.0, None, inputs["out"])

    def call():
        os.environ["KVFORGE_CPP_PREFILL"] = flag
        torch.ops.kvforge_cpp.paged_attention(*args)

    return call


def sdpa_call(lengths: list[int], num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype):
    """PyTorch's causal SDPA over the same prompts held contiguously (what vLLM's
    CPU backend runs for prefill), one call per prompt, as a thunk."""
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(1, num_heads, n, head_size, generator=g).to(dtype),
               torch.randn(1, num_kv_heads, n, head_size, generator=g).to(dtype),
               torch.randn(1, num_kv_heads, n, head_size, generator=g).to(dtype)) for n in lengths]

    def call():
        for q, k, v in inputs:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=num_heads != num_kv_heads)

    return call


def best_interleaved(calls: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Best-of-`repeats` seconds of each thunk by `clock`, the thunks taking turns
    round by round, so the load of a busy machine drifts over all of them alike."""
    for call in calls.values():
        call()  # first-call costs
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            best[name] = min(best[name], clock() - start)
    return best


def measure(lengths: list[int], *, num_heads: int = 8, num_kv_heads: int = 4, head_size: int = 64,
            dtypes=("float32", "bfloat16"), threads: int | None = None, repeats: int = 5,
            compare_before: bool = True) -> dict:
    """GFLOP/s of the prefill tile (`after`), of the tiles before it (`before`) and
    of contiguous SDPA (`sdpa`) per dtype, with the float32 GEMM peak at the same
    thread count, all interleaved (best_interleaved)."""
    from kvforge.kernels import build

    build.load()
    if threads:
        torch.set_num_threads(threads)
    flops = prefill_flops(lengths, num_heads, head_size)
    n = 1024
    calls = {f"gemm/{kernel}": gemm_call(n, kernel) for kernel in gemm_kernels()}
    for name in dtypes:
        dtype = getattr(torch, name)
        inputs = prefill_inputs(lengths, num_heads, num_kv_heads, head_size, dtype)
        calls[f"{name}/after"] = prefill_call(inputs, head_size, "on")
        if compare_before:
            calls[f"{name}/before"] = prefill_call(inputs, head_size, "off")
        calls[f"{name}/sdpa"] = sdpa_call(lengths, num_heads, num_kv_heads, head_size, dtype)
    previous = os.environ.get("KVFORGE_CPP_PREFILL")
    try:
        # One thread: this process's CPU time, which other jobs on a crowded machine
        # disturb far less than elapsed time; more threads: elapsed time.
        clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
        best = best_interleaved(calls, repeats, clock)
    finally:
        if previous is None:
            os.environ.pop("KVFORGE_CPP_PREFILL", None)
        else:
            os.environ["KVFORGE_CPP_PREFILL"] = previous
    gemms = {key.split("/")[1]: 2 * n**3 / best.pop(key) / 1e9 for key in list(best) if key.startswith("gemm/")}
    gemm = max(gemms.values())  # the peak, whichever kernel reaches it, as the machine section takes it
    result = {"lengths": lengths, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
              "threads": torch.get_num_threads(), "isa": torch.ops.kvforge_cpp.isa(), "repeats": repeats,
              "clock": "cpu" if clock is time.process_time else "elapsed",
              "flops_convention": "4*d per visible (query, key) pair per query head: causal halves 4*q*k*d",
              "gemm_gflops": gemm, "gemm_kernels": gemms, "dtypes": {}}
    for key, seconds in best.items():
        name, label = key.split("/")
        result["dtypes"].setdefault(name, {})[label] = {"ms": seconds * 1e3, "gflops": flops / seconds / 1e9}
    for entry in result["dtypes"].values():
        entry["fraction_of_gemm"] = entry["after"]["gflops"] / gemm
    return result


def markdown(result: dict) -> list[str]:
    """The figures as report lines."""
    shape = (f"{len(result['lengths'])} prompt(s) of {', '.join(map(str, result['lengths']))} tokens, "
             f"{result['num_heads']} heads / {result['num_kv_heads']} KV heads of {result['head_size']}, "
             f"{result['threads']} thread(s), {result['isa']}, best of {result['repeats']} by "
             f"{'CPU' if result['clock'] == 'cpu' else 'elapsed'} time")
    kernels = ", ".join(f"{k} {v:.1f}" for k, v in result.get("gemm_kernels", {}).items())
    lines = [f"Prefill attention kernel ({shape}; FLOPs: {result['flops_convention']}), "
             f"against the float32 GEMM peak at **{result['gemm_gflops']:.1f} GFLOP/s** (n=1024, timed alongside"
             + (f": {kernels}" if kernels else "") + "):", "",
             "| dtype | ms | GFLOP/s | of GEMM peak | before (older tiles) GFLOP/s | torch SDPA, contiguous, GFLOP/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, entry in result["dtypes"].items():
        before = f"{entry['before']['gflops']:.1f}" if entry.get("before") else ""
        lines.append(f"| {name} | {entry['after']['ms']:.1f} | {entry['after']['gflops']:.1f} "
                     f"| {entry['fraction_of_gemm']:.0%} | {before} | {entry['sdpa']['gflops']:.1f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048", help="prompt lengths, comma-separated (default: 2048)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each figure is its best (default: 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    result = measure([int(n) for n in args.lengths.split(",")], num_heads=args.heads, num_kv_heads=args.kv_heads,
                     head_size=args.head_size, dtypes=args.dtype.split(","), threads=args.threads,
                     repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else "\n".join(markdown(result)))


if __name__ == "__main__":
    main()
