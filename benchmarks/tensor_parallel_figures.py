"""Tensor parallelism figures: decode tokens/s, the communication share of a step,
and weight and KV memory per rank, at TP=1 and TP=2.

    python -m kvforge.benchmarks.tensor_parallel_figures [--model bench-llama-50m] [--batch 1 16]

Each configuration builds a fresh engine, prefills `--batch` requests of
`--prompt` tokens untimed, then times `--steps` decode steps. "comm" is the
time rank 0 spends inside collectives (its all-reduces and the step broadcast),
waiting for the other rank included, as a share of the timed steps. TP=1 is
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


def measure(path: str, tp: int, threads: int, batch: int, prompt: int, steps: int) -> dict:
    from kvforge import LLMEngine, SamplingParams
    from kvforge.core import EngineConfig

    torch.set_num_threads(threads)  # the workers take the driver's count
    config = EngineConfig.model_validate({
        "model": path, "device": "cpu", "dtype": "float32", "cache": {"num_blocks": batch * 8 + 8},
        "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": max(2048, batch * prompt)},
        "parallel": {"tensor_parallel_size": tp}})
    engine = LLMEngine(config)
    try:
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(prompt)], params=params)
        engine.step()  # the whole prefill (one step: the budget holds every prompt)
        engine.step()  # one decode step to settle, untimed
        group = engine.executor.group if engine.executor is not None else None
        comm_before = group.comm_seconds if group is not None else 0.0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
        comm = (group.comm_seconds - comm_before) if group is not None else 0.0
        if engine.executor is not None:
            memory = engine.executor.memory
        else:
            memory = [(engine.model.weight_bytes(), sum(c.numel() * c.element_size() for c in engine.runner.kv_caches))]
        return {"tp": tp, "threads_per_rank": threads, "batch": batch, "tokens_per_s": batch * steps / elapsed,
                "step_ms": elapsed / steps * 1e3, "comm_share": comm / elapsed,
                "weight_mb_per_rank": [round(w / 1e6, 1) for w, _ in memory],
                "kv_mb_per_rank": [round(k / 1e6, 2) for _, k in memory]}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-llama-50m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    args = parser.parse_args(argv)
    path = str(model_dir(args.model))
    t = args.threads_per_rank
    print("| batch | configuration | decode tok/s | step ms | comm share | weights MB per rank | KV MB per rank |")
    print("|---:|---|---:|---:|---:|---|---|")
    for batch in args.batch:
        for tp, threads in [(1, t), (1, 2 * t), (2, t)]:
            row = measure(path, tp, threads, batch, args.prompt, args.steps)
            print(f"| {batch} | TP={tp}, {threads} thread(s) per rank | {row['tokens_per_s']:.1f} | "
                  f"{row['step_ms']:.1f} | {row['comm_share']:.0%} | {row['weight_mb_per_rank']} | "
                  f"{row['kv_mb_per_rank']} |", flush=True)
            print(json.dumps(row), file=sys.stderr)


if __name__ == "__main__":
    main()
