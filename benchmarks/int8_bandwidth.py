"""How fast the int8 linear kernels read their weights, against how fast this
host reads memory at all (docs/quantization.md, "The weight-only kernel").

For each layer shape of a synthetic bench model (default `bench-llama-25m`:
qkv, o, gate and up, down, head), each row count, weight-only (`activations`
"none") and W8A8 ("int8"), float32 and bfloat16 rows, and for weight-only both weight layouts
(packed, as `Int8Linear` keeps it, and `[out, in]` rows): the weight bytes read
per second of one call through `Int8Linear`, as the models run it. Enough
copies of the layer (different weights, together `--cold-mib`, well past the
last-level cache) are called in turn that every call reads its weight from
memory, as a decode step of a model bigger than the cache does; the copies sit
on 2 MiB pages as `quantize_linears` puts a model's. The memory figure is a
float32 `.sum()` over a buffer of the same size: one stream read front to
back, what a kernel that only reads its weight could reach. The call overhead
(a 64 x 16 layer at one row) is what every call pays on top of its reading.

One thread, CPU time (`time.thread_time`); each figure is the median over
`rounds` passes over all copies.

    OMP_NUM_THREADS=1 python -m kvforge.benchmarks.int8_bandwidth [--rows 1,4,32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvforge.core import cdiv
from kvforge.models.quantized_linear import Int8Linear, place_on_huge_pages

from .model_dirs import SYNTHETIC

ROWS = (1, 4, 32)
ACTIVATIONS = ("none", "int8")
DTYPES = ("float32", "bfloat16")
COLD_MIB = 96  # three times this host's 32 MiB L3


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """Layer name -> (out, in) of a synthetic bench model as its int8 layers hold them
    (q/k/v fused into one weight; gate and up two layers of one shape)."""
    c = SYNTHETIC[model]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head = hidden // c["num_attention_heads"]
    return {"qkv": (hidden + 2 * c["num_key_value_heads"] * head, hidden), "o": (hidden, hidden),
            "gate, up": (inter, hidden), "down": (hidden, inter), "head": (c["vocab_size"], hidden)}


def cold_layers(out: int, k: int, activations: str, cold_bytes: int, layout: str = "packed") -> list[Int8Linear]:
    """Copies of an `out` x `k` int8 layer holding `cold_bytes` of weights in all, on 2 MiB pages;
    `layout` "rows" keeps each weight `[out, in]` where the layer would pack it."""
    copies = max(2, cdiv(cold_bytes, out * k))
    layers = [Int8Linear(torch.randint(-127, 128, (out, k), dtype=torch.int8), torch.rand(out) * 0.01 + 1e-3,
                         None, activations) for _ in range(copies)]
    if layout == "rows":
        for layer in layers:
            layer.weight_int8 = layer.int8_rows()
    place_on_huge_pages(layers)
    return layers


def layout_of(layer: Int8Linear) -> str:
    return "packed" if layer.weight_int8.dim() == 3 else "rows"


def call_overhead_us(activations: str, rounds: int) -> float:
    """Microseconds of one call of a 64 x 16 layer at one row: the dispatch and
    allocation every call pays whatever its size."""
    layer = Int8Linear(torch.randint(-127, 128, (64, 16), dtype=torch.int8), torch.rand(64), None, activations)
    x = torch.randn(1, 16)
    calls = [lambda: layer(x)] * 2000
    _seconds(calls)
    return 1e6 * statistics.median(_seconds(calls) for _ in range(rounds)) / len(calls)


def _seconds(calls) -> float:
    start = time.thread_time()
    for call in calls:
        call()
    return time.thread_time() - start


def memory_gbs(cold_bytes: int, rounds: int) -> float:
    """GB/s of a float32 `.sum()` over `cold_bytes`: one thread reading memory front to back."""
    buffer = torch.randn(cold_bytes // 4)
    buffer.sum()
    return cold_bytes / statistics.median(_seconds([buffer.sum]) for _ in range(rounds)) / 1e9


@torch.no_grad()
def table(model: str = "bench-llama-25m", rows=ROWS, activations=ACTIVATIONS, dtypes=DTYPES, rounds: int = 5,
          cold_mib: int = COLD_MIB) -> list[dict]:
    """One row per (layer, activations, dtype, rows): the weight's GB/s and us per call."""
    results = []
    for name, (out, k) in layer_shapes(model).items():
        for act in activations:
            for layout in ("packed", "rows"):
                layers = cold_layers(out, k, act, cold_mib << 20, layout)
                if layout_of(layers[0]) != layout:
                    continue  # W8A8 layers read [out, in] only: no packed run
                for dtype in dtypes:
                    for m in rows:
                        x = torch.randn(m, k).to(getattr(torch, dtype))
                        calls = [lambda layer=layer: layer(x) for layer in layers]
                        _seconds(calls)  # warm: first-touch of the outputs, the kernel's dispatch
                        seconds = statistics.median(_seconds(calls) for _ in range(rounds))
                        results.append({"layer": name, "out": out, "in": k, "activations": act, "layout": layout,
                                        "dtype": dtype, "rows": m, "us": 1e6 * seconds / len(layers),
                                        "gbs": out * k * len(layers) / seconds / 1e9})
                del layers
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama-25m", choices=sorted(SYNTHETIC))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--activations", default=",".join(ACTIVATIONS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold-mib", type=int, default=COLD_MIB)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"memory read (float32 .sum() over {args.cold_mib} MiB): "
          f"{memory_gbs(args.cold_mib << 20, args.rounds):.1f} GB/s", flush=True)
    for act in args.activations.split(","):
        print(f"call overhead, activations {act}: {call_overhead_us(act, args.rounds):.1f} us", flush=True)
    print("| layer | out x in | activations | layout | dtype | rows | us | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table(args.model, [int(m) for m in args.rows.split(",")], args.activations.split(","),
                   args.dtypes.split(","), args.rounds, args.cold_mib):
        print(f"| {r['layer']} | {r['out']} x {r['in']} | {r['activations']} | {r['layout']} | {r['dtype']} | "
              f"{r['rows']} | {r['us']:.1f} | {r['gbs']:.1f} |", flush=True)
    print(f"memory read again: {memory_gbs(args.cold_mib << 20, args.rounds):.1f} GB/s")


if __name__ == "__main__":
    main()
