"""Tune the `triton` backend's launch on a GPU: time every combination of keys
per tile, warps, pipelining stages and KV splits (decode) or query rows per tile
(prefill) on one shape, check each against the default launch's output, and
print them fastest first with the bandwidth (decode: bytes of keys and values
read / time) or the attention FLOP/s (prefill).

    python -m kvforge.benchmarks.triton_sweep [--seqs 64 --context 4096 --json FILE]
    python -m kvforge.benchmarks.triton_sweep --prefill [--seqs 4 --context 1024]

The winning settings become the backend's defaults only after a run here says
so (docs/gpu_backends.md keeps the measured table).
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument("--prefill", action="store_true", help="a prompt batch (no cached context) instead of decode")
    parser.add_argument("--seqs", type=int, help="sequences (default 64 decode, 4 prefill)")
    parser.add_argument("--context", type=int, help="tokens per sequence (default 4096 decode, 1024 prefill)")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="a KV quantizer (int8, fp8_e4m3, fp8_e5m2): decode over a quantized cache, also "
                             "sweeping the hardware fp8 conversion against the bit-operation decoding")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", help="write every row to this file as well")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    seqs, tokens = args.seqs or (4 if args.prefill else 64), args.context or (1024 if args.prefill else 4096)
    q_heads, kv_heads = args.heads
    if args.prefill:  # a whole prompt per sequence, causal
        shape = Shape("prefill", seqs, 0, tokens, q_heads, kv_heads, args.head_size, 16, torch.bfloat16)
        work = seqs * q_heads * tokens * (tokens + 1) / 2 * args.head_size * 4  # QK^T and PV over the causal half
        unit, per_ms = "TFLOP/s", work / 1e9  # GFLOP per ms = TFLOP/s
        grid = [dict(query_rows=r, block_n=n, num_warps=w, num_stages=st, splits=1)
                for r, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    else:
        shape = Shape("decode", seqs, tokens, 1, q_heads, kv_heads, args.head_size, 16, torch.bfloat16,
                      args.kv_cache_dtype)
        unit, per_ms = "GB/s", shape.kv_bytes() / 1e6  # MB per ms = GB/s
        if args.kv_cache_dtype == "auto":
            grid = [dict(query_rows=None, block_n=n, num_warps=w, num_stages=st, splits=sp)
                    for n, w, st, sp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4))]
        else:
            natives = (False, True) if args.kv_cache_dtype.startswith("fp8") else (False,)
            grid = [dict(query_rows=None, block_n=n, num_warps=w, num_stages=st, splits=1, native_fp8=nat)
                    for nat, n, w, st in itertools.product(natives, (64, 128), (4, 8), (2, 3))]
    w = workload(shape, "cuda")
    cls = build_registry().get(ATTENTION_BACKEND, "triton").cls
    layer = AttentionLayerSpec(shape.num_heads, shape.num_kv_heads, shape.head_size)
    default = cls(layer, shape.cache_spec(), "cuda")
    default_plan = default.plan(w.batch)
    expected = default.forward(w.query, w.cache, default_plan)
    rows = [dict(query_rows=default_plan.block_q * default.qpk_pad, block_n=default_plan.block_n,
                 num_warps=default.launch_options(default_plan)["num_warps"], num_stages=None,
                 splits=default_plan.num_splits, default=True, max_diff=0.0,
                 ms=median_ms(lambda: default.forward(w.query, w.cache, default_plan), args.repeat))]
    for launch in grid:
        backend = cls(layer, shape.cache_spec(), "cuda")
        backend.query_rows, backend.block_n = launch["query_rows"], launch["block_n"]
        backend.num_warps, backend.num_stages = launch["num_warps"], launch["num_stages"]
        backend.native_fp8 = launch.get("native_fp8")
        plan = backend.plan(w.batch)
        if launch["splits"] > 1:  # force the split count (the default policy splits only small grids)
            split_len = cdiv(cdiv(shape.seq_len, launch["splits"]), plan.block_n) * plan.block_n
            plan = dataclasses.replace(plan, num_splits=cdiv(shape.seq_len, split_len), split_len=split_len)
        row = dict(launch, query_rows=plan.block_q * backend.qpk_pad, splits=plan.num_splits, default=False)
        try:
            out = backend.forward(w.query, w.cache, plan)
            row["max_diff"] = (out.float() - expected.float()).abs().max().item()
            row["ms"] = median_ms(lambda: backend.forward(w.query, w.cache, plan), args.repeat)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
    print(f"triton paged {shape.name}, {shape.num_seqs} seqs x {shape.seq_len} tokens, heads {shape.num_heads}/"
          f"{shape.num_kv_heads} x {shape.head_size}, bfloat16")
    print(f"KV cache: {shape.kv_cache_dtype}; native: fp8 codes converted by the hardware (None: the default)")
    print(f"{'rows':>5} {'block_n':>7} {'warps':>5} {'stages':>6} {'splits':>6} {'native':>6} {'ms':>8} {unit:>8} "
          f"{'max diff':>9}")
    for r in sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"]):
        r["rate"] = per_ms / r["ms"]
        print(f"{r['query_rows']:>5} {r['block_n']:>7} {r['num_warps']:>5} {str(r['num_stages']):>6} {r['splits']:>6} "
              f"{str(r.get('native_fp8')):>6} {r['ms']:>8.3f} {r['rate']:>8.1f} {r['max_diff']:>9.2e}" + ("  (default)" if r["default"] else ""))
    for r in rows:
        if "error" in r:
            print(f"{r['query_rows']:>5} {r['block_n']:>7} {r['num_warps']:>5} {str(r['num_stages']):>6} "
                  f"{r['splits']:>6} failed: {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    # bfloat16 output of the same sums in another order: differences beyond this are wrong results
    wrong = [r for r in rows if r.get("max_diff", 0.0) > 2e-2]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
