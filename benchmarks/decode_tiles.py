"""The linears with the tiles a path takes for a few rows (a decode's rows, one
verifying drafts; on AVX2 four-block tiles and walks, and every bfloat16 row
count; on AVX-512 one-stream tiles and 5-8-row float32 tiles) and without
(`KVFORGE_WIDE_TILES=off`), side by side (docs/models.md, "Four-block tiles
for a decode", "Walking four blocks for 4-7 rows" and "One stream on
AVX-512").

Every linear of a synthetic bench model's decoder stack and head (default
`bench-llama-50m`: per layer the fused q/k/v, o with its residual, the fused
gate and up with SiLU, down with its residual; then the head), packed once per
dtype on 2 MiB pages, as a loaded model's weights are. For each dtype and row
count the stack runs with `KVFORGE_WIDE_TILES=off` (the path's own tile at
every row count: on AVX2 3 x 2 for float32, 2 x 2 for bfloat16; on AVX-512
4 x 4 and 8 x 2) and on (the
default), in turn (which goes first alternates), as a decode step calls them:
each weight read from memory once per pass. The outputs of the two are checked
bitwise equal. One thread, CPU time (`time.thread_time`), the median of
`rounds` passes each.

    OMP_NUM_THREADS=1 python -m kvforge.benchmarks.decode_tiles [--model bench-llama-25m] [--rows 1,2,3] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvforge.core import FLOAT_DTYPES
from kvforge.models.cpp_linear import interleave_blocks, kernel_path, linear, load_kernel, pack_weight
from kvforge.models.huge_pages import on_huge_pages

from .model_dirs import SYNTHETIC

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 64)
DTYPES = ("float32", "bfloat16")  # names in FLOAT_DTYPES
SETTINGS = ("off", "on")  # KVFORGE_WIDE_TILES


def stack_shapes(model: str) -> list[tuple[str, int, int, str]]:
    """(name, out, in, epilogue) of each linear a step of `model` calls, in order."""
    c = SYNTHETIC[model]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head = hidden // c["num_attention_heads"]
    layer = [("qkv", hidden + 2 * c["num_key_value_heads"] * head, hidden, "none"), ("o", hidden, hidden, "add"),
             ("gate_up", inter, hidden, "silu_mul"), ("down", hidden, inter, "add")]
    return layer * c["num_hidden_layers"] + [("head", c["vocab_size"], hidden, "none")]


def packed_stack(shapes, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """The packed weights of `shapes` (gate and up interleaved), on 2 MiB pages."""
    generator = torch.Generator().manual_seed(seed)
    weights = [[(torch.randn(out, k, generator=generator) * 0.02).to(dtype)
                for _ in range(2 if ep == "silu_mul" else 1)] for _, out, k, ep in shapes]
    packed = [interleave_blocks(*(pack_weight(w) for w in ws)) if len(ws) == 2 else pack_weight(ws[0])
              for ws in weights]
    return on_huge_pages(packed)


def run_stack(shapes, packed, inputs, setting: str) -> list[torch.Tensor]:
    """Every linear once on its inputs (`inputs[in]`) with KVFORGE_WIDE_TILES=`setting`; the outputs."""
    os.environ["KVFORGE_WIDE_TILES"] = setting
    outs = []
    for (_, out, k, ep), weight in zip(shapes, packed):
        other = inputs[("residual", out)] if ep == "add" else None
        outs.append(linear(inputs[k], weight, out, None, ep, other))
    return outs


@torch.no_grad()
def table(model: str = "bench-llama-50m", rows=ROWS, rounds: int = 9) -> list[dict]:
    """One row per (dtype, row count): ms per pass over the stack off and on, and the ratio."""
    load_kernel()
    shapes = stack_shapes(model)
    before = os.environ.get("KVFORGE_WIDE_TILES")
    results = []
    try:
        for dtype_name in DTYPES:
            dtype = FLOAT_DTYPES[dtype_name]
            packed = packed_stack(shapes, dtype)
            weight_bytes = sum(p.nbytes for p in packed)
            for m in rows:
                inputs = {}
                for _, out, k, ep in shapes:
                    inputs.setdefault(k, torch.randn(m, k).to(dtype))
                    if ep == "add":
                        inputs.setdefault(("residual", out), torch.randn(m, out).to(dtype))
                first = {s: run_stack(shapes, packed, inputs, s) for s in SETTINGS}  # warm, and the bits
                if not all(torch.equal(a, b) for a, b in zip(first["off"], first["on"])):
                    raise AssertionError(f"{dtype_name} outputs at {m} rows differ with and without four-block tiles")
                seconds = {s: [] for s in SETTINGS}
                for r in range(rounds):
                    for s in (SETTINGS if r % 2 else reversed(SETTINGS)):
                        start = time.thread_time()
                        run_stack(shapes, packed, inputs, s)
                        seconds[s].append(time.thread_time() - start)
                off, on = (statistics.median(seconds[s]) for s in SETTINGS)
                results.append({"dtype": dtype_name, "rows": m, "off_ms": 1e3 * off, "on_ms": 1e3 * on,
                                "speedup": off / on, "off_gbs": weight_bytes / off / 1e9,
                                "on_gbs": weight_bytes / on / 1e9})
            del packed
    finally:
        if before is None:
            os.environ.pop("KVFORGE_WIDE_TILES", None)
        else:
            os.environ["KVFORGE_WIDE_TILES"] = before
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama-50m", choices=sorted(SYNTHETIC))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"kernel path: {kernel_path()}")
    print("| weights | rows | off ms | on ms | on faster | weights GB/s, off / on |")
    print("|---|---|---|---|---|---|")
    for r in table(args.model, [int(m) for m in args.rows.split(",")], args.rounds):
        print(f"| {r['dtype']} | {r['rows']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['off_gbs']:.1f} / {r['on_gbs']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
