"""Tensor and pipeline parallelism figures: decode tokens/s, each rank's compute
and communication per step, and weight and KV memory per rank, at TP=1, TP=2
(vocabulary-parallel embedding and head, and replicated), PP=2 and TP=2 x PP=2;
with `--loading`, what each rank reads and holds while loading its part.

    python -m kvforge.benchmarks.tensor_parallel_figures [--model bench-llama-50m] [--batch 1 16] [--device cuda]
    python -m kvforge.benchmarks.tensor_parallel_figures --loading

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
    tp, pp = parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1)
    name = " x ".join(([f"TP={tp}"] if tp > 1 else []) + ([f"PP={pp}"] if pp > 1 else [])) or "one process"
    return name + (", embedding and head replicated" if tp > 1 and not parallel.get("vocab_parallel", True) else "")


def memory_mb() -> dict[str, float]:
    """This process's peak and current resident memory, split into private (anonymous)
    and file-backed pages (the checkpoint's mmap, shared libraries), in MB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}


def load_rank(path: str, tp: int, pp: int, rank: int, queue) -> None:
    """In a fresh process: load rank `rank`'s part as that rank would, and report the bytes
    it read, the bytes it holds, and how much its memory rose while loading (after a
    first, tiny load, so lazy imports do not count)."""
    from kvforge.core import EngineConfig
    from kvforge.distributed.shard_loading import RankPart, dry_run_groups
    from kvforge.models import load_model

    torch.set_num_threads(1)
    config = EngineConfig.model_validate({"model": path, "parallel": {"tensor_parallel_size": tp,
                                                                      "pipeline_parallel_size": pp}})
    load_model("kvforge-tiny", dtype="float32", linear_kernel="torch")  # imports and first-use buffers, not counted
    before = memory_mb()
    part = RankPart(dry_run_groups(config, rank)) if tp * pp > 1 else None
    model = load_model(path, dtype="float32", linear_kernel="torch", shard=part)
    after = memory_mb()
    queue.put((model.checkpoint_bytes_read, model.weight_bytes(), {k: after[k] - before[k] for k in after}))


def loading_table(path: str) -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    print("| configuration | rank | checkpoint MB read | weights MB held | peak RSS rise, MB | private MB rise | "
          "file-backed MB rise |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        for rank in range(tp * pp):
            queue = context.Queue()
            process = context.Process(target=load_rank, args=(path, tp, pp, rank, queue))
            process.start()
            read, held, rise = queue.get(timeout=600)
            process.join()
            name = describe({"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
            print(f"| {name} | {rank} | {read / 1e6:.1f} | {held / 1e6:.1f} | {rise['VmHWM']:.0f} | "
                  f"{rise['RssAnon']:.0f} | {rise['RssFile']:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-llama-50m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank (TP=2 and PP=2 need two); no thread-count rows")
    parser.add_argument("--loading", action="store_true", help="only the loading table: bytes read and held per rank")
    args = parser.parse_args(argv)
    path = str(model_dir(args.model))
    if args.loading:
        loading_table(path)
        return
    t = args.threads_per_rank
    print("| batch | configuration | decode tok/s | step ms | compute ms per step, by rank | comm share, by rank | "
          "weights MB per rank | KV MB per rank |")
    print("|---:|---|---:|---:|---|---|---|---|")
    runs = [({}, t), ({}, 2 * t), ({"tensor_parallel_size": 2}, t),
            ({"tensor_parallel_size": 2, "vocab_parallel": False}, t), ({"pipeline_parallel_size": 2}, t),
            ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, t)]
    if args.device == "cuda":  # one GPU per rank, no thread-count rows
        runs = [(parallel, threads) for parallel, threads in runs if threads == t and
                parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1)
                <= torch.cuda.device_count()]
    for batch in args.batch:
        for parallel, threads in runs:
            row = measure(path, parallel, threads, batch, args.prompt, args.steps, args.device)
            print(f"| {batch} | {describe(parallel)}, {threads} thread(s) per rank | {row['tokens_per_s']:.1f} | "
                  f"{row['step_ms']:.1f} | {row['compute_ms']} | {row['comm_share']} | {row['weight_mb']} | "
                  f"{row['kv_mb']} |", flush=True)
            print(json.dumps(row), file=sys.stderr)

if __name__ == "__main__":
    main()
