"""Scheduler settings measured on the bench scenarios: the kvforge engine alone,
one configuration per value of a scheduler setting, in rounds that alternate
the values (A, B, C, A, B, C, ...) so a busy machine's drift falls on all of
them alike; each value's median output tokens/s and its ratio to the first.

    python -m kvforge.benchmarks.scheduler_sweep --scenarios mixed,long-prompt \\
        --values 2048,4096,8192 --rounds 3 [--quick] [--dtype bfloat16]

The defaults of core/config.py's SchedulerConfig are chosen from these figures
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def sweep(scenario_names: list[str], setting: str, values: list[int], *, rounds: int, quick: bool,
          dtype: str = "float32", threads: int = 1, kv_cache_gib: float | None = None, per_cpu_second: bool = False,
          max_requests: int | None = None, log=print) -> dict:
    """{scenario: {value: {"tokens_per_s": [...], "median": x, "ratio": x / first median}}}; with
    `per_cpu_second` (one thread only) the figures are output tokens per second of
    the engine process's CPU time, which other jobs on a crowded machine disturb
    far less than elapsed time."""
    if per_cpu_second and threads != 1:
        raise ValueError(f"per_cpu_second measures one thread's work; got threads={threads}")
    from . import harness, scenarios
    from .model_dirs import FULL_MODEL, QUICK_MODEL, model_dir, scenario_model_dir
    from .scenarios import Run

    model = QUICK_MODEL if quick else FULL_MODEL
    path = model_dir(model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gib = kv_cache_gib or (0.5 if quick else 2.0)
    out: dict = {"setting": setting, "values": values, "rounds": rounds, "quick": quick, "dtype": dtype,
                 "threads": threads, "per_cpu_second": per_cpu_second, "max_requests": max_requests, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in scenario_names:
            scenario = scenarios.build(name, vocab, quick)
            scenario.requests = scenario.requests[:max_requests]
            own = scenario_model_dir(scenario, model, path)
            base = next(r.options for r in scenario.runs if r.peer == "kvforge")
            speeds: dict[int, list[float]] = {v: [] for v in values}
            for round_ in range(rounds):
                for value in values:
                    options = {**base, "scheduler": {**base.get("scheduler", {}), setting: value}}
                    scenario.runs = [Run(f"{setting}={value}", "kvforge", options)]
                    summary = harness.run_scenario(scenario, str(own), Path(tmp), peers={"kvforge": sys.executable},
                                                   dtype=dtype, kv_cache_gib=gib, threads=threads, log=lambda _: None)
                    (run,) = summary["runs"]
                    if run["status"] != "ok":
                        raise RuntimeError(f"{name} {setting}={value}: {run['status']}")
                    tokens = run["metrics"]["output_tokens"]
                    speeds[value].append(tokens / run["info"]["cpu_s"] if per_cpu_second else
                                         run["metrics"]["tokens_per_s"])
                    log(f"[{name}] round {round_ + 1}/{rounds} {setting}={value}: "
                        f"{speeds[value][-1]:.1f} output tok/{'CPU ' if per_cpu_second else ''}s")
            first = statistics.median(speeds[values[0]])
            out["scenarios"][name] = {str(v): {"tokens_per_s": s, "median": statistics.median(s),
                                               "ratio": statistics.median(s) / first} for v, s in speeds.items()}
    return out


def markdown(result: dict) -> list[str]:
    values = result["values"]
    lines = ["| scenario | " + " | ".join(f"{result['setting']}={v}" for v in values) + " |",
             "|---|" + "---:|" * len(values)]
    for name, row in result["scenarios"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[str(v)]['median']:.1f} ({row[str(v)]['ratio']:.2f}x)"
                                              for v in values) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="mixed,long-prompt")
    parser.add_argument("--setting", default="max_num_batched_tokens", help="a SchedulerConfig field")
    parser.add_argument("--values", default="2048,4096,8192")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true",
                        help="output tokens per CPU second of the engine process (one thread), not per elapsed second")
    parser.add_argument("--max-requests", type=int, default=None, metavar="N", help="the first N requests only")
    args = parser.parse_args(argv)
    result = sweep(args.scenarios.split(","), args.setting, [int(v) for v in args.values.split(",")],
                   rounds=args.rounds, quick=args.quick, dtype=args.dtype, threads=args.threads,
                   per_cpu_second=args.cpu_time, max_requests=args.max_requests, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
