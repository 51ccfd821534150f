"""Where one engine step's time goes: schedule, build inputs, the model's plan
(attention metadata), forward,
logits, sample, apply the result (`update_from_output`) and the rest of
`LLMEngine.step` (output objects, group bookkeeping).

The phases are timed by wrapping the engine's own methods on the instance, so
the engine carries no timing code; a wrapper costs about a microsecond, against
steps of hundreds. The clock is this thread's CPU time by default
(`time.thread_time`): on a shared machine, wall time also counts the time other
processes held the core, which swamps a split of microseconds. It is the right
clock with one torch thread (`--threads 1`, the bench's setting); with more, work
on the other threads is not counted, so use `--clock wall` then.

    python -m kvforge.benchmarks.step_profile --model bench-llama-tiny --batch 1 32
    python -m kvforge.benchmarks.step_profile --torch-profiler 32   # also torch.profiler's top ops
    python -m kvforge.benchmarks.step_profile --model bench-llama-25m --batch1-engine  # the batch1 scenario's step
"""

from __future__ import annotations

import argparse
import json
import time

from .machine import EVERY_STEP

# (label, owner attribute of the engine or None for the engine itself, method name)
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("build inputs", "runner", "build_batch"),
    ("plan", "model", "plan"),
    ("forward", "model", "forward"),
    ("logits", "model", "compute_logits"),
    ("sample", "step_sampler", "sample"),
    ("apply result", "scheduler", "update_from_output"),
    ("outputs", None, "_output"),
)


class StepClock:
    """Seconds spent in each phase of `LLMEngine.step`, accumulated over the steps
    run while it is attached; `total` is the seconds of whole steps."""

    def __init__(self, engine, clock=time.thread_time):
        self.engine = engine
        self.clock = clock
        self.seconds = {label: 0.0 for label, _, _ in PHASES}
        self.total = 0.0
        self.steps = 0
        self._originals = []
        for label, owner, name in PHASES:
            target = engine if owner is None else getattr(engine, owner)
            original = getattr(target, name)
            self._originals.append((target, name, target.__dict__.get(name)))
            setattr(target, name, self._timed(label, original))
        step = engine.step
        self._originals.append((engine, "step", engine.__dict__.get("step")))

        def timed_step(*args, **kwargs):
            start = clock()
            try:
                return step(*args, **kwargs)
            finally:
                self.total += clock() - start
                self.steps += 1

        engine.step = timed_step

    def add_phase(self, label: str, target, name: str) -> None:
        """Time `target.name` too, as the phase `label` (put back by `detach`)."""
        self.seconds[label] = 0.0
        self._originals.append((target, name, target.__dict__.get(name)))
        setattr(target, name, self._timed(label, getattr(target, name)))

    def _timed(self, label, fn):
        seconds, clock = self.seconds, self.clock

        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += clock() - start

        return wrapper

    def reset(self) -> None:
        for label in self.seconds:  # in place: the wrappers hold this dict
            self.seconds[label] = 0.0
        self.total, self.steps = 0.0, 0

    def detach(self) -> None:
        """Put the engine's own methods back."""
        for target, name, own in reversed(self._originals):
            if own is None:
                delattr(target, name)
            else:
                setattr(target, name, own)
        self._originals = []

    def split(self) -> dict:
        """Microseconds per step of each phase, `other` (the rest of the step) and
        `outside model` (everything but forward and logits)."""
        steps = max(1, self.steps)
        per = {label: s / steps * 1e6 for label, s in self.seconds.items()}
        per["other"] = self.total / steps * 1e6 - sum(per.values())
        step_us = self.total / steps * 1e6
        model_us = per["plan"] + per["forward"] + per["logits"]  # machine.ModelClock's split
        return {"steps": self.steps, "step_us": step_us, "model_us": model_us,
                "outside_model_us": step_us - model_us,
                "outside_fraction": (step_us - model_us) / step_us if step_us else 0.0, "phases_us": per}


def make_engine(model_dir: str, batch: int, prompt_len: int, dtype: str = "float32", weights: str | None = None,
                activations: str = "none"):
    """An engine as the bench's (machine.make_engine), in `dtype`, with `weights` quantized."""
    from kvforge import LLMEngine
    from kvforge.core import load_config

    config = load_config(model=model_dir, device="cpu", dtype=dtype, cache={"memory_budget": 2**30},
                         quantization={"weights": weights, "activations": activations},
                         scheduler={**EVERY_STEP, "max_num_seqs": batch,
                                    "max_num_batched_tokens": max(2048, batch * prompt_len)}).config
    return LLMEngine(config)


def step_linears(model) -> list:
    """The model's linear layers in the order a step runs them, the LM head last."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj")
    found = []
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            found += [getattr(part, n) for n in names if getattr(part, n, None) is not None]
    head = getattr(model, "lm_head_layer", None)
    return found + ([head] if head is not None else [])


def linear_seconds(model, rows: int, passes: int = 20, repeats: int = 3, clock=time.thread_time) -> dict:
    """Microseconds of one pass over `step_linears` on `rows` rows, and on zero rows
    (the calls' fixed cost); the best of `repeats` windows of `passes` passes."""
    import torch

    layers = step_linears(model)
    inputs = {rows_: [torch.randn(rows_, layer.in_features).to(model.dtype) for layer in layers]
              for rows_ in (rows, 0)}
    best = {}
    with torch.inference_mode():
        for rows_, xs in inputs.items():
            for layer, x in zip(layers, xs):
                layer(x)  # warm
            for _ in range(repeats):
                start = clock()
                for _ in range(passes):
                    for layer, x in zip(layers, xs):
                        layer(x)
                us = (clock() - start) / passes * 1e6
                best[rows_] = min(best.get(rows_, us), us)
    return {"linears_us": best[rows], "calls_us": best[0], "kernels_us": best[rows] - best[0],
            "linear_layers": len(layers)}


def decode_split(model_dir: str, batch: int, steps: int = 50, prompt_len: int = 8, repeats: int = 3,
                 clock=time.thread_time, temperature: float = 0.0, detokenize: bool = False, dtype: str = "float32",
                 weights: str | None = None, activations: str = "none", linear_split: bool = False) -> dict:
    """The step split of `steps` pure-decode steps at `batch` running requests
    (EOS ignored), the best (least disturbed) of `repeats` windows. The defaults
    are the bench peers' requests: greedy, token ids only. `linear_split` adds
    `linear_seconds` at `batch` rows."""
    from kvforge import SamplingParams

    engine = make_engine(model_dir, batch, prompt_len, dtype, weights, activations)
    params = SamplingParams(max_tokens=repeats * steps + 4, ignore_eos=True, temperature=temperature,
                            detokenize=detokenize)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(prompt_len)], params=params)
    while engine.stats.num_prompt_tokens < batch * prompt_len:
        engine.step()
    engine.step()
    clock = StepClock(engine, clock)
    best = None
    for _ in range(repeats):
        clock.reset()
        for _ in range(steps):
            engine.step()
        split = clock.split()
        if best is None or split["step_us"] < best["step_us"]:
            best = split
    clock.detach()
    while engine.has_unfinished_requests():
        engine.step()
    extra = {"decoder_stack": getattr(engine.model, "decoder_stack", None) is not None}
    if linear_split:
        extra.update(linear_seconds(engine.model, batch, clock=clock.clock))
    return {"batch": batch, **best, **extra}


def batch1_engine_split(model_dir: str, dtype: str = "float32", temperature: float = 0.0, prompt_len: int = 512,
                        steps: int = 100, repeats: int = 3, clock=time.thread_time, seed: int | None = 0) -> dict:
    """The step split at batch 1 as the batch1 scenario runs it: one request decoding
    after a `prompt_len`-token prompt, in `dtype`, prefix caching off, greedy or
    seeded sampling at `temperature`, token ids only. Best of `repeats` windows of
    `steps` decode steps; `outside_model_us` is the engine's own cost per step."""
    from kvforge import LLMEngine, SamplingParams
    from kvforge.core import load_config

    config = load_config(model=model_dir, device="cpu", dtype=dtype, cache={"memory_budget": 2**28,
                                                                            "enable_prefix_caching": False},
                         scheduler={**EVERY_STEP, "max_num_seqs": 1,
                                    "max_num_batched_tokens": max(2048, prompt_len)}).config
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=repeats * steps + 4, ignore_eos=True, temperature=temperature,
                            seed=None if temperature == 0 else seed, detokenize=False)
    engine.add_request("b1", prompt_token_ids=[3 + (j * 7) % 200 for j in range(prompt_len)], params=params)
    engine.step()  # the prompt in one step (max_num_batched_tokens >= prompt_len)
    engine.step()  # one decode to settle
    step_clock = StepClock(engine, clock)
    best = None
    for _ in range(repeats):
        step_clock.reset()
        for _ in range(steps):
            engine.step()
        split = step_clock.split()
        if best is None or split["step_us"] < best["step_us"]:
            best = split
    step_clock.detach()
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": 1, "dtype": dtype, "temperature": temperature, **best}


def format_batch1_split(splits: list[dict]) -> str:
    """A Markdown table of `batch1_engine_split` results: one row per (dtype, sampling)."""
    labels = list(splits[0]["phases_us"])
    engine_labels = [label for label in labels if label not in ("plan", "forward", "logits")]
    lines = ["| dtype | sampling | step µs | model µs | " + " | ".join(engine_labels) + " | outside the model |",
             "|---|---|---:|---:|" + "---:|" * len(engine_labels) + "---:|"]
    for s in splits:
        sampling = "greedy" if s["temperature"] == 0 else f"seeded, T={s['temperature']:g}"
        cells = " | ".join(f"{s['phases_us'][label]:.0f}" for label in engine_labels)
        lines.append(f"| {s['dtype']} | {sampling} | {s['step_us']:.0f} | {s['model_us']:.0f} | {cells} | "
                     f"{s['outside_model_us']:.0f} µs |")
    return "\n".join(lines)


def torch_profile(model_dir: str, batch: int, steps: int = 20, prompt_len: int = 8, rows: int = 25) -> str:
    """torch.profiler's table (self CPU time) over `steps` decode steps at `batch`."""
    import torch
    from kvforge import SamplingParams

    from .machine import make_engine

    engine = make_engine(model_dir, batch, prompt_len)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(prompt_len)], params=params)
    while engine.stats.num_prompt_tokens < batch * prompt_len:
        engine.step()
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def format_split(splits: list[dict]) -> str:
    """A Markdown table: one row per batch, one column per phase (µs per step)."""
    labels = list(splits[0]["phases_us"])
    lines = ["| batch | step µs | " + " | ".join(labels) + " | outside the model |",
             "|---:|---:|" + "---:|" * len(labels) + "---:|"]
    for s in splits:
        cells = " | ".join(f"{s['phases_us'][label]:.0f}" for label in labels)
        lines.append(f"| {s['batch']} | {s['step_us']:.0f} | {cells} | "
                     f"{s['outside_model_us']:.0f} µs ({s['outside_fraction']:.0%}) |")
    if "kernels_us" in splits[0]:
        lines += ["", "| batch | C++ decoder stack | step µs | linear kernels µs | their calls' fixed cost µs | "
                      "everything else µs |", "|---:|---|---:|---:|---:|---:|"]
        for s in splits:
            lines.append(f"| {s['batch']} | {'on' if s['decoder_stack'] else 'off'} | {s['step_us']:.0f} | "
                         f"{s['kernels_us']:.0f} ({s['linear_layers']} layers) | {s['calls_us']:.0f} | "
                         f"{s['step_us'] - s['kernels_us']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import torch

    from .model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-llama-tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="this thread's CPU time (default; robust on a shared machine) or wall time")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default, as the bench): greedy")
    parser.add_argument("--detokenize", action="store_true", help="decode text too (the bench peers do not)")
    parser.add_argument("--dtype", default="float32", help="the model dtype (float32, bfloat16)")
    parser.add_argument("--weights", default=None, help="a weight quantizer, e.g. int8_weight (default: float)")
    parser.add_argument("--activations", default="none", choices=("none", "int8"), help="with --weights: int8 is W8A8")
    parser.add_argument("--linear-split", action="store_true",
                        help="also time the linear kernels alone: the step's weight-reading time against the rest")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--torch-profiler", type=int, metavar="BATCH", help="also print torch.profiler's top ops")
    parser.add_argument("--batch1-engine", action="store_true",
                        help="instead: the batch1 scenario's step (512-token prompt, float32 and bfloat16, greedy "
                             "and seeded T=1), split into the engine's phases")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(model_dir(args.model))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.batch1_engine:
        splits = [batch1_engine_split(path, dtype, temperature, steps=args.steps, repeats=args.repeats, clock=clock)
                  for dtype in ("float32", "bfloat16") for temperature in (0.0, 1.0)]
        print(json.dumps(splits, indent=2) if args.json else format_batch1_split(splits))
        return
    splits = [decode_split(path, b, args.steps, repeats=args.repeats, clock=clock, temperature=args.temperature,
                           detokenize=args.detokenize, dtype=args.dtype, weights=args.weights,
                           activations=args.activations, linear_split=args.linear_split) for b in args.batch]
    print(json.dumps(splits, indent=2) if args.json else format_split(splits))
    if args.torch_profiler:
        print(torch_profile(path, args.torch_profiler))


if __name__ == "__main__":
    main()
