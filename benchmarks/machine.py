"""The machine's own limits, and how close the engine gets to them.

* `gemm_gflops`: a large float32 matmul, the practical peak of this machine: the
  best of `torch.mm` and the oneDNN packed-weight linear the models run.
* `decode_profile`: decode steps of the reference engine at a given batch, split
  into time inside the model (plan + forward + logits) and time outside it
  (scheduling, batch building, sampling, bookkeeping), with the model FLOPs
  each step does; `mfu` relates those FLOPs to the GEMM peak.

The engine has no per-step timing hook, so the model's `plan`, `forward` and
`compute_logits` are wrapped on the instance for the measurement.

    python -m kvforge.benchmarks.machine [--quick] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time

import torch

from .work import attention_pair_flops, layer_weights, logits_flops


def describe() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def gemm_kernels() -> list[str]:
    """The float32 GEMM kernels available here: `torch.mm` ("torch") and, where
    oneDNN runs, the packed-weight linear the models run ("onednn")."""
    from kvforge.models.packed_linear import onednn_unavailable

    return ["torch"] + ([] if onednn_unavailable(torch.float32, torch.device("cpu")) else ["onednn"])


def gemm_call(n: int, kernel: str = "torch"):
    """A float32 n x n x n matmul by `kernel` (see gemm_kernels), ready to call."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    if kernel == "onednn":
        from kvforge.models.packed_linear import PackedLinear

        return functools.partial(PackedLinear(b, None), a)  # a b^T: the same FLOPs
    return functools.partial(torch.mm, a, b)


def gemm_gflops(n: int = 2048, repeats: int = 5, kernel: str = "torch") -> float:
    """Best-of-`repeats` float32 GFLOP/s of gemm_call(n, kernel)."""
    call = gemm_call(n, kernel)
    call()  # first-call costs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def gemm_peak(sizes) -> dict[str, float]:
    """The best GFLOP/s of each GEMM kernel available here over `sizes`."""
    return {k: max(gemm_gflops(n, kernel=k) for n in sizes) for k in gemm_kernels()}


def decode_flops(hf_config: dict, batch: int, context: int) -> float:
    """Model FLOPs of one decode step: 2 per weight per token for every matmul
    (attention projections, MLP, LM head) plus attention over `context` tokens
    (counted as benchmarks/work.py counts them)."""
    weights, _ = layer_weights(hf_config)
    layers = hf_config["num_hidden_layers"]
    return batch * (2 * layers * weights + logits_flops(hf_config) + layers * attention_pair_flops(hf_config) * context)


class ModelClock:
    """Accumulates the seconds spent inside the model's plan/forward/compute_logits."""

    def __init__(self, model):
        self.seconds = 0.0
        for name in ("plan", "forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


# The scheduler setting of every engine whose steps are timed one by one (decode
# profiles, step splits): each engine step one decode pass, since a multi-step
# burst (the default, docs/engine.md) runs its passes inside one call.
EVERY_STEP = {"num_scheduler_steps": 1}


def make_engine(model_dir: str, batch: int, prompt_len: int):
    from kvforge import LLMEngine
    from kvforge.core import load_config

    config = load_config(model=model_dir, device="cpu", dtype="float32",
                         cache={"memory_budget": 2**30},
                         scheduler={**EVERY_STEP, "max_num_seqs": batch,
                                    "max_num_batched_tokens": max(2048, batch * prompt_len)}).config
    return LLMEngine(config)


def decode_profile(model_dir: str, batch: int, steps: int = 8, prompt_len: int = 8, engine=None) -> dict:
    """Time `steps` pure-decode steps at `batch` running requests."""
    from kvforge import SamplingParams

    engine = engine or make_engine(model_dir, batch, prompt_len)
    clock = ModelClock(engine.model)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(prompt_len)], params=params)
    while engine.stats.num_prompt_tokens < batch * prompt_len:  # prefill (and its first tokens) untimed
        engine.step()
    engine.step()  # one decode step to settle
    clock.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    context = prompt_len + steps // 2 + 2
    return {"batch": batch, "steps": steps, "step_s": total / steps, "model_s": clock.seconds / steps,
            "overhead_fraction": (total - clock.seconds) / total, "flops_per_step": decode_flops(hf, batch, context)}


def mfu(profile: dict, peak_gflops: float) -> float:
    """Model FLOP utilisation of a decode profile against the GEMM peak."""
    return profile["flops_per_step"] / profile["step_s"] / (peak_gflops * 1e9)


def measure(model_dir: str, quick: bool = False, batches=(1, 32, 128), mfu_batch: int = 64,
            threads: int | None = None, rounds: int = 1) -> dict:
    """The machine section of a bench run, with `threads` torch threads (the
    engines' count, so MFU compares like with like). With `rounds` > 1 the GEMM
    peak and the decode profiles are measured in turn, round after round, and
    each keeps its best round: a host whose speed drifts during the run then
    weighs on both sides of the MFU alike, as `--repeats` does for the engines.
    `mfu_rounds` is each round's decode against that round's own peak."""
    if threads:
        torch.set_num_threads(threads)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    steps = 3 if quick else 10
    sizes = (1024, 2048) if quick else (1024, 2048, 4096)
    measured = []  # per round: (kernels, {batch: profile})
    for _ in range(rounds):
        kernels = gemm_peak(sizes)
        measured.append((kernels, {b: decode_profile(model_dir, b, steps) for b in sorted(set(batches) | {mfu_batch})}))
    kernels = {k: max(r[0][k] for r in measured) for k in measured[0][0]}
    profiles = {b: min((r[1][b] for r in measured), key=lambda p: p["step_s"]) for b in measured[0][1]}
    peak = max(kernels.values())  # MFU against the fastest GEMM here, whichever the model uses
    at = profiles[mfu_batch]
    return {"machine": describe(), "gemm_gflops": peak, "gemm_kernels": kernels, "model_dir": model_dir,
            "rounds": rounds,
            "decode": {"batch": mfu_batch, "step_ms": at["step_s"] * 1e3,
                       "achieved_gflops": at["flops_per_step"] / at["step_s"] / 1e9, "mfu": mfu(at, peak),
                       "mfu_model_only": at["flops_per_step"] / at["model_s"] / (peak * 1e9),
                       "mfu_rounds": [mfu(r[1][mfu_batch], max(r[0].values())) for r in measured]},
            "overhead": {str(b): {"step_ms": p["step_s"] * 1e3, "model_ms": p["model_s"] * 1e3,
                                  "fraction": p["overhead_fraction"]} for b, p in profiles.items() if b in batches}}


if __name__ == "__main__":
    from .model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="bench-llama-50m")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="measure the GEMM peak and the decode profiles in "
                        "turn N times; each keeps its best round")
    args = parser.parse_args()
    print(json.dumps(measure(str(model_dir(args.model)), args.quick, threads=args.threads, rounds=args.rounds),
                     indent=2))
