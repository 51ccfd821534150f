"""Tune the `triton` backend's paged decode on a GPU: time every combination of
keys per tile, warps, pipelining stages and KV splits on one decode shape,
check each against the default launch's output, and print them fastest first
with the bandwidth achieved (bytes of keys and values read / time).

    python -m kvforge.benchmarks.triton_decode_sweep [--seqs 64 --context 4096 --json FILE]

The winning settings become the backend's defaults only after a run here says
so (docs/gpu_backends.md keeps the measured table).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from kvforge.benchmarks.bench_attention import Shape, workload
from kvforge.core import ATTENTION_BACKEND, AttentionLayerSpec, build_registry, cdiv


def median_ms(call, repeat: int) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", help="write every row to this file as well")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_decode_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    shape = Shape("decode", args.seqs, args.context, 1, args.heads[0], args.heads[1], args.head_size, 16,
                  torch.bfloat16)
    w = workload(shape, "cuda")
    cls = build_registry().get(ATTENTION_BACKEND, "triton").cls
    layer = AttentionLayerSpec(shape.num_heads, shape.num_kv_heads, shape.head_size)
    default = cls(layer, shape.cache_spec(), "cuda")
    default_plan = default.plan(w.batch)
    expected = default.forward(w.query, w.cache, default_plan)
    default_ms = median_ms(lambda: default.forward(w.query, w.cache, default_plan), args.repeat)
    rows = [dict(block_n=default_plan.block_n, num_warps=default.launch_options(default_plan)["num_warps"],
                 num_stages=None, splits=default_plan.num_splits, ms=default_ms, default=True, max_diff=0.0)]
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4)):
        backend = cls(layer, shape.cache_spec(), "cuda")
        backend.block_n, backend.num_warps, backend.num_stages = block_n, warps, stages
        plan = backend.plan(w.batch)
        if splits > 1:  # force the split count (the default policy splits only small grids)
            split_len = cdiv(cdiv(shape.seq_len, splits), block_n) * block_n
            plan = type(plan)(plan.batch, plan.tile_seq, plan.tile_start, plan.block_q, plan.block_n,
                              cdiv(shape.seq_len, split_len), split_len)
        row = dict(block_n=block_n, num_warps=warps, num_stages=stages, splits=plan.num_splits, default=False)
        try:
            out = backend.forward(w.query, w.cache, plan)
            row["max_diff"] = (out.float() - expected.float()).abs().max().item()
            row["ms"] = median_ms(lambda: backend.forward(w.query, w.cache, plan), args.repeat)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
    gigabytes = shape.kv_bytes() / 1e9
    print(f"triton paged decode, {shape.num_seqs} seqs x {shape.seq_len} tokens, heads {shape.num_heads}/"
          f"{shape.num_kv_heads} x {shape.head_size}, bfloat16, {gigabytes:.2f} GB of KV read per call")
    print(f"{'block_n':>7} {'warps':>5} {'stages':>6} {'splits':>6} {'ms':>8} {'GB/s':>8} {'max diff':>9}")
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for r in timed:
        r["GB_per_s"] = gigabytes / (r["ms"] / 1e3)
        print(f"{r['block_n']:>7} {r['num_warps']:>5} {str(r['num_stages']):>6} {r['splits']:>6} {r['ms']:>8.3f} "
              f"{r['GB_per_s']:>8.0f} {r['max_diff']:>9.2e}" + ("  (default)" if r["default"] else ""))
    for r in rows:
        if "error" in r:
            print(f"{r['block_n']:>7} {r['num_warps']:>5} {str(r['num_stages']):>6} {r['splits']:>6} failed: {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    # bfloat16 output of the same sums in another order: differences beyond this are wrong results
    wrong = [r for r in rows if r.get("max_diff", 0.0) > 2e-2]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
