"""The batched LoRA op's CPU paths side by side: kvforge's C++ op
(`kvforge_cpp::add_lora`) against the torch loop (`add_lora_torch`), at a
decode step of many adapters and a prefill of one (docs/models.md, "Batched
LoRA").

Each figure is the median over `rounds` of the mean CPU time (`time.thread_time`)
of `reps` calls, the two paths alternated; one thread unless OMP_NUM_THREADS
says otherwise.

    OMP_NUM_THREADS=1 python -m kvforge.benchmarks.lora_kernels [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvforge.core import dtype_name
from kvforge.kernels import build
from kvforge.kernels.lora_ops import add_lora_torch

SIZE = 2048  # in and out features
RANK = 16
# name: (segment lengths, their slots, slots)
CASES = {
    "decode: 32 tokens, 16 adapters x 2": ([2] * 16, list(range(16)), 16),
    "decode: 32 tokens, 32 one-token segments": ([1] * 32, [i % 16 for i in range(32)], 16),
    "prefill: 512 tokens, 1 adapter": ([512], [0], 1),
}


def operands(lengths: list[int], slots: list[int], count: int, dtype: torch.dtype):
    tokens = sum(lengths)
    starts = torch.tensor([0] + lengths).cumsum(0)
    return (torch.randn(tokens, SIZE).to(dtype), torch.randn(tokens, SIZE).to(dtype),
            torch.randn(count, RANK, SIZE).to(dtype), torch.randn(count, RANK, SIZE).to(dtype), starts,
            torch.tensor(slots))


def cpu_ms(fn, args, reps: int) -> float:
    fn(*args)
    start = time.thread_time()
    for _ in range(reps):
        fn(*args)
    return (time.thread_time() - start) / reps * 1e3


def time_paths(rounds: int = 5) -> list[tuple[str, str, float, float]]:
    """(dtype, case, C++ ms, torch ms) for every case, float32 and bfloat16."""
    build.load()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (lengths, slots, count) in CASES.items():
            args = operands(lengths, slots, count, dtype)
            reps = 5 if sum(lengths) > 64 else 20
            cpp, torch_ms = [], []
            for _ in range(rounds):
                cpp.append(cpu_ms(torch.ops.kvforge_cpp.add_lora, args, reps))
                torch_ms.append(cpu_ms(add_lora_torch, args, reps))
            rows.append((dtype_name(dtype), name, statistics.median(cpp), statistics.median(torch_ms)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    build.load()
    print(f"C++ path: {torch.ops.kvforge_cpp.lora_path()}, threads: {torch.get_num_threads()}")
    print(f"{'dtype':9} {'case':42} {'C++ ms':>8} {'torch ms':>9} {'speed-up':>8}")
    for dtype, name, cpp, torch_ms in time_paths(args.rounds):
        print(f"{dtype:9} {name:42} {cpp:8.3f} {torch_ms:9.3f} {torch_ms / cpp:7.1f}x")


if __name__ == "__main__":
    main()
