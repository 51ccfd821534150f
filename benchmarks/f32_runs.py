"""float32 weights in one run and in four runs, side by side (docs/models.md,
"float32 weights in four runs").

Every linear of a synthetic bench model's decoder stack and head (default
`bench-llama-50m`: per layer the fused q/k/v, o with its residual, the fused
gate and up with SiLU, down with its residual; then the head), packed twice
from the same weights: `[blocks, in, 16]` and `[blocks, 4, in / 4, 16]`, each
stack on 2 MiB pages as a loaded model's weights are. For each row count both
stacks run in turn (which goes first alternates), as a decode step calls them:
each weight read from memory once per pass. The outputs of the two are
checked bitwise equal. One thread, CPU time (`time.thread_time`), the median
of `rounds` passes each.

    OMP_NUM_THREADS=1 python -m kvforge.benchmarks.f32_runs [--model bench-llama-25m] [--rows 1,5,64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvforge.models.cpp_linear import interleave_blocks, linear, load_kernel, pack_weight
from kvforge.models.huge_pages import on_huge_pages

from .model_dirs import SYNTHETIC

ROWS = (1, 2, 3, 5, 6, 8, 16, 64, 512)
LAYOUTS = {"one run": 1, "four runs": 4}


def stack_shapes(model: str) -> list[tuple[str, int, int, str]]:
    """(name, out, in, epilogue) of each linear a step of `model` calls, in order."""
    c = SYNTHETIC[model]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head = hidden // c["num_attention_heads"]
    layer = [("qkv", hidden + 2 * c["num_key_value_heads"] * head, hidden, "none"), ("o", hidden, hidden, "add"),
             ("gate_up", inter, hidden, "silu_mul"), ("down", hidden, inter, "add")]
    return layer * c["num_hidden_layers"] + [("head", c["vocab_size"], hidden, "none")]


def packed_stacks(shapes, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Each layout's packed weights of `shapes` (gate and up interleaved), from one draw."""
    generator = torch.Generator().manual_seed(seed)
    weights = [[torch.randn(out, k, generator=generator) * 0.02 for _ in range(2 if ep == "silu_mul" else 1)]
               for _, out, k, ep in shapes]
    stacks = {}
    for name, runs in LAYOUTS.items():
        packed = [interleave_blocks(*(pack_weight(w, runs=runs) for w in ws)) if len(ws) == 2
                  else pack_weight(ws[0], runs=runs) for ws in weights]
        stacks[name] = on_huge_pages(packed)
    return stacks


def run_stack(shapes, packed, inputs) -> list[torch.Tensor]:
    """Every linear once on its inputs (`inputs[in]`); the outputs."""
    outs = []
    for (_, out, k, ep), weight in zip(shapes, packed):
        x = inputs[k]
        other = inputs[("residual", out)] if ep == "add" else None
        outs.append(linear(x, weight, out, None, ep, other))
    return outs


@torch.no_grad()
def table(model: str = "bench-llama-50m", rows=ROWS, rounds: int = 7) -> list[dict]:
    """One row per row count: each layout's ms per pass over the stack, and the ratio."""
    load_kernel()
    shapes = stack_shapes(model)
    stacks = packed_stacks(shapes)
    weight_bytes = sum(p.nbytes for p in stacks["one run"])
    results = []
    for m in rows:
        inputs = {}
        for _, out, k, ep in shapes:
            inputs.setdefault(k, torch.randn(m, k))
            if ep == "add":
                inputs.setdefault(("residual", out), torch.randn(m, out))
        seconds = {name: [] for name in LAYOUTS}
        first = {name: run_stack(shapes, stacks[name], inputs) for name in LAYOUTS}  # warm, and the bits
        if not all(torch.equal(a, b) for a, b in zip(first["one run"], first["four runs"])):
            raise AssertionError(f"the two layouts' outputs differ at {m} rows")
        for r in range(rounds):
            for name in (LAYOUTS if r % 2 else reversed(LAYOUTS)):
                start = time.thread_time()
                run_stack(shapes, stacks[name], inputs)
                seconds[name].append(time.thread_time() - start)
        one, four = (statistics.median(seconds[name]) for name in LAYOUTS)
        results.append({"rows": m, "one_run_ms": 1e3 * one, "four_runs_ms": 1e3 * four, "speedup": one / four,
                        "one_run_gbs": weight_bytes / one / 1e9, "four_runs_gbs": weight_bytes / four / 1e9})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama-50m", choices=sorted(SYNTHETIC))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| rows | one run ms | four runs ms | four runs faster | weights GB/s, one / four |")
    print("|---|---|---|---|---|")
    for r in table(args.model, [int(m) for m in args.rows.split(",")], args.rounds):
        print(f"| {r['rows']} | {r['one_run_ms']:.2f} | {r['four_runs_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['one_run_gbs']:.1f} / {r['four_runs_gbs']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
