"""int8 weights against float32: kernels, model bytes and decode tokens/s.

* kernels: one linear layer at 1, 8, 32 and 128 rows (`--rows`: prefill sizes
  too) for the ~50M model's weight shapes (in x out: 512x512, 512x1536,
  1536x512, and 512x16384, the LM head), median microseconds of each candidate:
  the float32 linears (oneDNN-packed, and kvforge's C++ `f32_linear`, which
  float32 models run on AVX-512), kvforge's `Int8Linear` weight-only (the C++ kernel,
  float32 and bfloat16 activations) and W8A8 (per-token int8 activations, the
  C++ `int8_dynamic_linear`: VNNI dot products or oneDNN's `_int_mm`), torch's weight-only `_weight_int8pack_mm` with float32 and
  with bfloat16 activations, and fbgemm's `quantized.linear_dynamic` (W8A8,
  one activation scale per tensor). torch's `_weight_int8pack_mm` with float32
  activations is left out past 128 rows: at 128 it already took over 40x float32.
* model: `weight_bytes()` and pure-decode tokens/s of the reference engine at
  batch 1 and 32 on `bench-llama-50m`, float32 against `quantization.weights =
  "int8_weight"` with `quantization.activations` "none" (weight-only) and
  "int8" (W8A8), the engines built in one process and timed in alternation;
  each figure is the median of `rounds` rounds (the machine is shared).

Everything runs on one thread (`torch.set_num_threads(1)`).

    pytest benchmarks/bench_weights.py --benchmark-only
    python -m kvforge.benchmarks.bench_weights [--quick] [--model NAME] [--kernels-only] [--rows 1 32 2048]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings

import pytest
import torch

from kvforge.benchmarks import machine
from kvforge.benchmarks.model_dirs import model_dir

MODEL = os.environ.get("BENCH_MODEL", "bench-llama-50m")
SHAPES = ((512, 512), (512, 1536), (1536, 512), (512, 16384))  # (in, out)
ROWS = (1, 8, 32, 128)
SLOW_PAST = 128  # rows past which the float32 `_weight_int8pack_mm` candidate is left out
# label -> (quantization.weights, quantization.activations); "float" is the model's dtype
WEIGHTS = {"float": (None, "none"), "int8 weight-only": ("int8_weight", "none"),
           "int8 W8A8": ("int8_weight", "int8")}


def _median_us(call, budget_s: float = 0.2, most: int = 200) -> float:
    call()  # first-call costs (oneDNN primitive creation)
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    repeats = int(min(most, max(3, budget_s / once)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def kernel_candidates(weight: torch.Tensor) -> dict:
    """name -> a function of the float32 input rows, for one `[out, in]` weight."""
    from kvforge.core import QUANTIZER, build_registry
    from kvforge.models.cpp_linear import CppLinear
    from kvforge.models.packed_linear import PackedLinear
    from kvforge.models.quantized_linear import Int8Linear

    q = build_registry().select(QUANTIZER, "int8_weight").cls().quantize(weight)
    weight_only = Int8Linear(q.data, q.scale, None, "none")
    scale = q.scale.reshape(-1)
    packed = PackedLinear(weight, None)
    candidates = {
        "float32 onednn": packed,
        "float32 kvforge (C++)": CppLinear(weight, None),
        "int8 kvforge weight-only f32 act (C++)": weight_only,
        "int8 kvforge weight-only bf16 act (C++)": lambda x: weight_only(x.bfloat16()),
        "int8 kvforge W8A8 (per-token, C++)": Int8Linear(q.data, q.scale, None, "int8"),
        "int8pack_mm f32 act": functools.partial(_int8pack, w=q.data, scale=scale, dtype=torch.float32),
        "int8pack_mm bf16 act": functools.partial(_int8pack, w=q.data, scale=scale, dtype=torch.bfloat16),
    }
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; measured for comparison only
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(weight, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0,
                                             torch.qint8)
        prepacked = torch.ops.quantized.linear_prepack(qweight, None)
    candidates["fbgemm linear_dynamic (W8A8 per-tensor)"] = functools.partial(
        torch.ops.quantized.linear_dynamic, W_prepack=prepacked, reduce_range=True)
    return candidates


def _int8pack(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x.to(dtype), w, scale.to(dtype)).float()


def kernel_table(shapes=SHAPES, rows=ROWS, budget_s: float = 0.2) -> list[dict]:
    """One row per (shape, rows): median microseconds of every candidate."""
    generator = torch.Generator().manual_seed(0)
    table = []
    for k, n in shapes:
        weight = torch.randn(n, k, generator=generator) * 0.02
        candidates = kernel_candidates(weight)
        for m in rows:
            x = torch.randn(m, k, generator=generator)
            times = {name: _median_us(functools.partial(fn, x), budget_s) for name, fn in candidates.items()
                     if not (m > SLOW_PAST and name == "int8pack_mm f32 act")}
            table.append({"in": k, "out": n, "rows": m, "us": times})
    return table


def make_engine(path: str, batch: int, weights: tuple[str | None, str], prompt_len: int = 8,
                dtype: str = "float32"):
    from kvforge import LLMEngine
    from kvforge.core import load_config

    config = load_config(model=path, device="cpu", dtype=dtype, cache={"memory_budget": 2**30},
                         quantization={"weights": weights[0], "activations": weights[1]},
                         scheduler={"max_num_seqs": batch,
                                    "max_num_batched_tokens": max(2048, batch * prompt_len)}).config
    return LLMEngine(config)


def decode_side_by_side(path: str, batches=(1, 32), steps: int = 10, rounds: int = 5,
                        dtype: str = "float32") -> dict:
    """Model bytes and median-of-`rounds` decode tokens/s per weight format and
    batch, the activations (and the float model) in `dtype`."""
    result: dict = {}
    for batch in batches:
        engines = {label: make_engine(path, batch, weights, dtype=dtype) for label, weights in WEIGHTS.items()}
        times: dict = {label: [] for label in engines}
        for _ in range(rounds):  # alternate, so all see the same disturbances
            for label, engine in engines.items():
                times[label].append(machine.decode_profile(path, batch, steps, engine=engine)["step_s"])
        for label, engine in engines.items():
            entry = result.setdefault(label, {"weight_bytes": engine.model.weight_bytes()})
            entry[f"batch_{batch}_tokens_per_s"] = batch / statistics.median(times[label])
        del engines
    return result


def print_tables(kernels: list[dict] | None, decode: dict | None, dtype: str = "float32") -> None:
    if kernels:
        names = list(kernels[0]["us"])
        print("| in x out | rows | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for row in kernels:
            times = " | ".join(f"{row['us'][n]:.0f}" if n in row["us"] else "" for n in names)
            print(f"| {row['in']}x{row['out']} | {row['rows']} | {times} |")
    if decode:
        base = decode["float"]
        print("\n| weights | model MB | batch 1 tok/s | batch 32 tok/s | speed-up b1 | speed-up b32 |")
        print("|---|---|---|---|---|---|")
        for label, entry in decode.items():
            print(f"| {dtype if label == 'float' else label} | {entry['weight_bytes'] / 1e6:.1f} | {entry['batch_1_tokens_per_s']:.1f} | "
                  f"{entry['batch_32_tokens_per_s']:.1f} | "
                  f"{entry['batch_1_tokens_per_s'] / base['batch_1_tokens_per_s']:.2f}x | "
                  f"{entry['batch_32_tokens_per_s'] / base['batch_32_tokens_per_s']:.2f}x |")


# pytest-benchmark

@pytest.fixture(scope="module")
def path() -> str:
    torch.set_num_threads(1)
    return str(model_dir(MODEL))


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_decode_step(benchmark, path, weights, batch):
    """One decode step at `batch` running requests; extra_info holds the model bytes and tokens/s."""
    from kvforge import SamplingParams

    engine = make_engine(path, batch, WEIGHTS[weights])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(8)], params=params)
    while engine.stats.num_prompt_tokens < batch * 8:  # prefill outside the timing
        engine.step()
    engine.step()
    benchmark.pedantic(engine.step, rounds=8, iterations=1)
    benchmark.extra_info.update(weight_bytes=engine.model.weight_bytes(),
                                tokens_per_s=batch / benchmark.stats.stats.min)
    assert len(engine.scheduler.running) == batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds per engine (the median counts)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows of the kernel table")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the decode table's model and activation dtype (the int8 layers' input)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine.describe())
    kernels = None if args.decode_only else kernel_table(rows=args.rows, budget_s=0.05 if args.quick else 0.2)
    decode = None if args.kernels_only else decode_side_by_side(
        str(model_dir(args.model)), steps=4 if args.quick else 10, rounds=2 if args.quick else args.rounds,
        dtype=args.dtype)
    print_tables(kernels, decode, args.dtype)


if __name__ == "__main__":
    main()
