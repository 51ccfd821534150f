"""Tensor and pipeline parallelism figures: decode tokens/s, each rank's compute
and communication per step, and weight and KV memory per rank, at TP=1, TP=2
and PP=2.

    python -m kvforge.benchmarks.tensor_parallel_figures [--model bench-llama-50m] [--batch 1 16] [--device cuda]

Each configuration builds a fresh engine, prefills `--batch` requests of
`--prompt` tokens untimed, then times `--steps` decode steps. "comm" is the
time rank 0 spends inside collectives (its all-reduces and the step broadcast),
waiting for the other rank included, as a share of the timed steps; "compute"
is each rank's forward time outside collectives, per step. TP=1 is
run at one thread and at `--threads-per-rank x 2` threads, so TP=2 (one process
per rank) can be compared with one process using the same cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvforge.benchmarks.model_dirs import model_dir


def measure(path: str, parallel: dict, threads: int, batch: int, prompt: int, steps: int,
            device: str = "cpu") -> dict:
    from kvforge import LLMEngine, SamplingParams
    from kvforge.core import EngineConfig

    torch.set_num_threads(threads)  # the workers take the driver's count
    config = EngineConfig.model_validate({
        "model": path, "device": device, "dtype": "float32", "cache": {"num_blocks": batch * 8 + 8},
        "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": max(2048, batch * prompt)},
        "parallel": parallel})
    engine = LLMEngine(config)
    try:
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(prompt)], params=params)
        engine.step()  # the whole prefill (one step: the budget holds every prompt)
        engine.step()  # one decode step to settle, untimed
        executor = engine.executor
        before = executor.timings() if executor is not None else None
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
        row = {"parallel": parallel, "threads_per_rank": threads, "batch": batch,
               "tokens_per_s": batch * steps / elapsed, "step_ms": elapsed / steps * 1e3}
        if executor is None:
            kv = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
            return {**row, "compute_ms": [], "comm_share": [],
                    "weight_mb": [round(engine.model.weight_bytes() / 1e6, 1)], "kv_mb": [round(kv / 1e6, 2)]}
        after = executor.timings()
        return {**row,
                "compute_ms": [round((a.compute_seconds - b.compute_seconds) / steps * 1e3, 1)
                               for a, b in zip(after, before)],
                "comm_share": [round((a.comm_seconds - b.comm_seconds) / elapsed, 2) for a, b in zip(after, before)],
                "weight_mb": [round(w / 1e6, 1) for w, _ in executor.memory],
                "kv_mb": [round(k / 1e6, 2) for _, k in executor.memory]}
    finally:
        engine.shutdown()


def describe(parallel: dict) -> str:
    if parallel.get("tensor_parallel_size", 1) > 1:
        return f"TP={parallel['tensor_parallel_size']}"
    if parallel.get("pipeline_parallel_size", 1) > 1:
        return f"PP={parallel['pipeline_parallel_size']}"
    return "one process"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-llama-50m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank (TP=2 and PP=2 need two); no thread-count rows")
    args = parser.parse_args(argv)
    path = str(model_dir(args.model))
    t = args.threads_per_rank
    print("| batch | configuration | decode tok/s | step ms | compute ms per step, by rank | comm share, by rank | "
          "weights MB per rank | KV MB per rank |")
    print("|---:|---|---:|---:|---|---|---|---|")
    runs = [({}, t), ({}, 2 * t), ({"tensor_parallel_size": 2}, t), ({"pipeline_parallel_size": 2}, t)]
    if args.device == "cuda":
        runs = [run for run in runs if run[1] == t]
    for batch in args.batch:
        for parallel, threads in runs:
            row = measure(path, parallel, threads, batch, args.prompt, args.steps, args.device)
            print(f"| {batch} | {describe(parallel)}, {threads} thread(s) per rank | {row['tokens_per_s']:.1f} | "
                  f"{row['step_ms']:.1f} | {row['compute_ms']} | {row['comm_share']} | {row['weight_mb']} | "
                  f"{row['kv_mb']} |", flush=True)
            print(json.dumps(row), file=sys.stderr)

if __name__ == "__main__":
    main()
