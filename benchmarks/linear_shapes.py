"""The three linear kernels at a model's layer shapes: what `linear_kernel`
"auto" decides from (docs/models.md, "float32 linear layers" and "bfloat16
linear layers").

For each layer of `bench-llama-tiny` and `bench-llama-50m` (qkv, o with its
residual add, gate and up with SiLU x up, down with its residual add, the
head with float32 logits out) and each row count, microseconds of one call
through torch `F.linear`, oneDNN-packed (`packed_linear`) and kvforge's C++ kernel (`cpp_linear`), each
run the way the models run it (`linear_act`, `linear_mul`, `linear_add`, or
the fused `CppGateUp`, its packed weight on 2 MiB pages as `use_cpp_linears`
puts a model's). One thread, CPU time (`time.thread_time`), freed heap
memory kept as the engine keeps it (`models.heap`: no page faults on each
call's output), the three kernels alternated `rounds` times; each figure is
the median over rounds.

    OMP_NUM_THREADS=1 python -m kvforge.benchmarks.linear_shapes --dtype float32 [--rows 1,8,32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvforge.models.heap import keep_freed_memory
from kvforge.models.cpp_linear import CppGateUp, CppLinear
from kvforge.models.huge_pages import on_huge_pages
from kvforge.models.packed_linear import PackedLinear, linear_act, linear_add, linear_mul, onednn_unavailable

from .model_dirs import SYNTHETIC

ROWS = (1, 8, 32, 64, 128, 512, 2048)
MODELS = ("bench-llama-tiny", "bench-llama-50m")
KERNELS = ("torch", "onednn", "cpp")


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """Layer name -> (out, in) of one of the synthetic bench models (gate_up: each of the two)."""
    c = SYNTHETIC[model]
    hidden, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c[
        "num_key_value_heads"]
    head = hidden // heads
    return {"qkv": (hidden + 2 * kv * head, hidden), "o": (hidden, hidden), "gate_up": (inter, hidden),
            "down": (hidden, inter), "head": (c["vocab_size"], hidden)}


def on_huge_pages_as_models_do(layer):
    """`layer` (a CppLinear or CppGateUp) with its packed weight on 2 MiB pages, where
    `use_cpp_linears` puts a model's."""
    layer.packed = on_huge_pages([layer.packed])[0]
    return layer


def layer_calls(name: str, out: int, k: int, rows: int, dtype: torch.dtype) -> dict:
    """Kernel -> a no-argument call running layer `name` as the models do (no "onednn"
    where oneDNN cannot run `dtype` on this CPU, e.g. bfloat16 without AVX-512)."""
    x = torch.randn(rows, k, dtype=dtype)
    residual = torch.randn(rows, out, dtype=dtype)
    onednn = onednn_unavailable(dtype, x.device) is None
    if name == "gate_up":
        gate, up = nn.Linear(k, out, bias=False).to(dtype), nn.Linear(k, out, bias=False).to(dtype)
        fused = on_huge_pages_as_models_do(CppGateUp(gate, up))
        calls = {"torch": lambda: linear_mul(up, x, linear_act(gate, x, "silu")), "cpp": lambda: fused(x)}
        if onednn:
            onednn_gate, onednn_up = PackedLinear(gate.weight, None), PackedLinear(up.weight, None)
            calls["onednn"] = lambda: linear_mul(onednn_up, x, linear_act(onednn_gate, x, "silu"))
        return calls
    plain = nn.Linear(k, out, bias=False).to(dtype)
    layers = {"torch": plain, "cpp": on_huge_pages_as_models_do(CppLinear(plain.weight, None,
                                                                         float_out=name == "head"))}
    if onednn:
        layers["onednn"] = PackedLinear(plain.weight, None)
    if name == "head":  # float32 logits, as `compute_logits` returns them (cpp writes them directly)
        return {kernel: (lambda layer=layer: layer(x).float()) for kernel, layer in layers.items()}
    other = residual if name in ("o", "down") else None
    return {kernel: (lambda layer=layer: linear_add(layer, x, other)) for kernel, layer in layers.items()}


def _seconds(call, reps: int) -> float:
    call()
    start = time.thread_time()
    for _ in range(reps):
        call()
    return (time.thread_time() - start) / reps


@torch.no_grad()
def table(dtype: torch.dtype, rows=ROWS, models=MODELS, rounds: int = 5) -> list[dict]:
    """One row per (model, layer, rows): median microseconds of each kernel."""
    results = []
    for model in models:
        for name, (out, k) in layer_shapes(model).items():
            for m in rows:
                calls = layer_calls(name, out, k, m, dtype)
                flops = 2 * m * k * out * (2 if name == "gate_up" else 1)
                reps = max(1, min(200, int(2e7 / flops)))
                times = {kernel: [] for kernel in calls}
                for _ in range(rounds):
                    for kernel, call in calls.items():
                        times[kernel].append(_seconds(call, reps))
                results.append({"model": model, "layer": name, "rows": m,
                                **{kernel: 1e6 * statistics.median(t) for kernel, t in times.items()}})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    print("| model | layer | rows | torch us | oneDNN us | cpp us | cpp vs best other |")
    print("|---|---|---|---|---|---|---|")
    for r in table(dtype, [int(r) for r in args.rows.split(",")], args.models.split(","), args.rounds):
        best = min(r["torch"], r.get("onednn", r["torch"]))
        onednn = f"{r['onednn']:.1f}" if "onednn" in r else "n/a"
        print(f"| {r['model'].removeprefix('bench-llama-')} | {r['layer']} | {r['rows']} | {r['torch']:.1f} | "
              f"{onednn} | {r['cpp']:.1f} | {best / r['cpp']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
