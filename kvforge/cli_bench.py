"""`kvforge bench`: the end-to-end scenarios side by side with their peers, the
machine's limits, a JSON file, a Markdown report and PNG plots.

    kvforge bench --quick
    kvforge bench mixed --peer vllm=~/venvs/vllm/bin/python --peer transformers=none

The transformers peers run with this Python unless turned off; vLLM only when
given its own. Exits 1 when a scenario's subject configuration failed, naming
it on stderr; any other failed configuration is named but leaves the status alone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from kvforge.benchmarks.model_dirs import FULL_MODEL, QUICK_MODEL, model_dir, scenario_model_dir

BENCH_DTYPES = ("float32", "bfloat16", "float16")


def add_parser(commands) -> None:
    from kvforge.benchmarks.scenarios import NAMES

    parser = commands.add_parser("bench", help="benchmark kvforge side by side with peers; JSON, Markdown and plots")
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help=f"any of: {', '.join(NAMES)} (default: all); or 'serve' alone: streamed requests with "
                             "Poisson arrivals against kvforge serve (and vLLM's server with --peer vllm=PYTHON)")
    parser.add_argument("--quick", action="store_true", help="small workloads and model: minutes on 2 CPU cores")
    parser.add_argument("--out", default="bench-results", metavar="DIR", help="where results go (default: bench-results)")
    parser.add_argument("--peer", action="append", metavar="NAME=PYTHON",
                        help="run peer NAME (vllm, generate, generate_batch; transformers = both) with this "
                             "Python, or not at all with NAME=none (repeatable). Default: both transformers "
                             "peers run with this Python (--peer transformers=none turns them off); vllm runs "
                             "only when given, e.g. vllm=~/venvs/vllm/bin/python; llama.cpp (batch1) takes "
                             "llama.cpp's bin directory or its llama-bench instead of a Python")
    parser.add_argument("--model", help=f"a local HF directory, a built-in name, or {QUICK_MODEL} / {FULL_MODEL} "
                                        f"(random weights, built on first use; default: {QUICK_MODEL} with --quick, "
                                        f"else {FULL_MODEL})")
    parser.add_argument("--machine-model", default=FULL_MODEL, help=f"model of the MFU/overhead figures (default: {FULL_MODEL})")
    parser.add_argument("--no-machine", action="store_true", help="skip the GEMM, MFU and step-overhead measurements")
    parser.add_argument("--dtype", choices=BENCH_DTYPES, default="float32",
                        help="model and activation dtype of every engine (default: float32; bfloat16 where the CPU "
                             "has it). The machine figures (GEMM peak, MFU) stay float32")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache of every engine, GiB (default: 0.5 quick, 2 full)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also run each scenario's kvforge subject with batch_invariant on (labelled "
                             "'<subject> batch_invariant'), its cost measured against the subject")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one configuration may run (default: 3600)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP/torch threads of every engine and of the machine figures (default: 1; 0 leaves "
                             "each engine its own default)")
    parser.add_argument("--repeats", type=int, default=1, help="N rounds of every configuration in turn; each keeps its fastest round, "
                        "and the ratios are also given round by round; the machine figures (GEMM peak and decode "
                        "profiles) take N rounds in turn too (default: 1)")
    parser.add_argument("--max-requests", type=int, default=None, metavar="N",
                        help="keep the first N requests of each workload (the same N for every engine), for "
                             "peers too slow for the whole workload")
    parser.add_argument("--rates", default=None, metavar="R1,R2,...",
                        help="serve only: arrival rates in requests/s (default: 1,2,4 with --quick, else 0.5,1,2,4,8)")
    parser.add_argument("--data-parallel-sizes", default="1", metavar="N1,N2,...",
                        help="serve only: run kvforge serve once per size, with --data-parallel-size N (named "
                             "kvforge-dpN in the results), all side by side (default: 1)")
    parser.add_argument("--ttft-target-ms", type=float, default=2000.0,
                        help="serve only: goodput counts requests with TTFT within this (default: 2000)")
    parser.add_argument("--tpot-target-ms", type=float, default=200.0,
                        help="serve only: ... and time per output token within this (default: 200)")
    parser.set_defaults(run=run)


def bench(scenario_names: list[str], *, quick: bool, out: Path, peers: dict[str, str], model: str,
          machine_model: str | None, kv_cache_gib: float, timeout: float, command: str, threads: int = 1,
          repeats: int = 1, max_requests: int | None = None, dtype: str = "float32", batch_invariant: bool = False,
          log=print) -> dict:
    """Run the scenarios and the machine measurements; write results.json,
    report.md and one PNG per scenario under `out`; return the results.
    `batch_invariant` adds `with_batch_invariant_run` to every scenario."""
    from kvforge.benchmarks import harness, report, scenarios

    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    missing = sorted({"generate", "generate_batch", "vllm", "llama.cpp"} - set(peers))
    if missing:
        log(f"peers not given, not run: {', '.join(missing)} (--peer NAME=PATH/TO/python; "
            "llama.cpp=PATH/TO/llama.cpp/build/bin)")
    off = sorted(name for name, python in peers.items() if python is None)
    if off:
        log(f"peers turned off, not run: {', '.join(off)}")
    results = {"command": command, "model": model, "model_dir": str(path), "dtype": dtype, "quick": quick,
               "peers": peers, "allocator_note": harness.allocator_note(peers), "threads": threads, "repeats": repeats,
               "max_requests": max_requests,
               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "scenarios": []}
    if machine_model:
        from kvforge.benchmarks import machine

        log("machine: GEMM peak, decode MFU, step overhead ...")
        results["machine"] = machine.measure(str(model_dir(machine_model)), quick, threads=threads, rounds=repeats)
    for name in scenario_names:
        scenario = scenarios.build(name, vocab, quick)
        if max_requests is not None:
            scenario.requests = scenario.requests[:max_requests]
        if batch_invariant:
            with_batch_invariant_run(scenario)
        scenario_path = scenario_model_dir(scenario, model, path)
        summary = harness.run_scenario(scenario, str(scenario_path), out, peers=peers, dtype=dtype,
                                       kv_cache_gib=kv_cache_gib, timeout=timeout, threads=threads,
                                       repeats=repeats, log=log)
        if scenario_path != path:
            summary["model_dir"] = str(scenario_path)
        if scenario.figures and summary.get("status") == "ok":
            log(f"[{name}] the scenario's own figures ...")
            summary.update(scenario.figures(summary, out / name, scenario_path))
        if scenario.prefill_figures and machine_model and summary.get("status") == "ok":
            log(f"[{name}] prefill attention kernel GFLOP/s ...")
            summary["prefill_attention"] = prefill_figures(scenario, scenario_path, dtype, threads)
        results["scenarios"].append(summary)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = report.markdown(results)
    (out / "report.md").write_text(text + "\n")
    results["plots"] = [str(p) for p in report.plots(results, out)]
    return results


BATCH_INVARIANT_COST = 1.15  # the mode may cost at most 15% of the subject's throughput


def with_batch_invariant_run(scenario) -> None:
    """Add to `scenario` its kvforge subject again with `batch_invariant` on, and a
    target: at least 1 / BATCH_INVARIANT_COST of the subject's throughput. A scenario
    whose subject is not a kvforge run is left as it is."""
    from kvforge.benchmarks.scenarios import Run, Target

    subject = next((run for run in scenario.runs if run.label == scenario.subject and run.peer == "kvforge"), None)
    if subject is None:
        return
    label = f"{subject.label} batch_invariant"
    scenario.runs.append(Run(label, "kvforge", {**subject.options, "batch_invariant": True}))
    scenario.targets.append(Target(f"{scenario.name}: batch_invariant >= {1 / BATCH_INVARIANT_COST:.2f}x "
                                   f"{subject.label} throughput", label, subject.label, "throughput",
                                   round(1 / BATCH_INVARIANT_COST, 2)))


def prefill_figures(scenario, path: Path, dtype: str, threads: int) -> dict:
    """The prefill attention kernel's GFLOP/s against the GEMM peak, on the
    scenario model's heads and its median prompt length (benchmarks/prefill_attention.py)."""
    from kvforge.benchmarks import prefill_attention

    config = json.loads((Path(path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    lengths = sorted(len(r["prompt_token_ids"]) for r in scenario.requests)
    return prefill_attention.measure([lengths[len(lengths) // 2]], num_heads=heads,
                                     num_kv_heads=config.get("num_key_value_heads") or heads,
                                     head_size=config.get("head_dim") or config["hidden_size"] // heads,
                                     dtypes=(dtype,), threads=threads or None)


def run(args: argparse.Namespace) -> int:
    from kvforge.benchmarks import harness, report
    from kvforge.benchmarks.scenarios import NAMES
    from kvforge.core import ConfigError

    if args.max_requests is not None and args.max_requests < 1:
        raise ConfigError(f"--max-requests must be at least 1, got {args.max_requests}")
    if "serve" in args.scenarios:
        if args.dtype != "float32":
            raise ConfigError(f"--dtype {args.dtype}: 'kvforge bench serve' runs both servers in float32 only; "
                              "drop --dtype, or run the offline scenarios (mixed, prefix, ...) in that dtype")
        return run_serve(args)
    names = args.scenarios or list(NAMES)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ConfigError(f"unknown scenario {unknown[0]!r}; choose from: {', '.join(NAMES)}")
    peers = harness.peer_pythons(args.peer)
    out = Path(args.out)
    results = bench(names, quick=args.quick, out=out, peers=peers,
                    model=args.model or (QUICK_MODEL if args.quick else FULL_MODEL),
                    machine_model=None if args.no_machine else args.machine_model,
                    kv_cache_gib=args.kv_cache_gib or (0.5 if args.quick else 2.0), timeout=args.timeout,
                    threads=args.threads, repeats=args.repeats, max_requests=args.max_requests, dtype=args.dtype,
                    batch_invariant=args.batch_invariant,
                    command="kvforge bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else names),
                    log=lambda line: print(line, file=sys.stderr))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plot(s)", file=sys.stderr)
    print(report.markdown(results))
    # Only a failed subject fails the run: every figure of its scenario is measured against it.
    # Any other configuration failing costs one comparison, and some fail by design (a
    # proposer that cannot serve the model says so), so they are named but pass.
    subjects = []
    for summary, entry in harness.failed_runs(results):
        if entry["label"] == summary["subject"]:
            subjects.append(summary["scenario"])
            print(f"error: {summary['scenario']}: subject configuration {entry['label']!r} {entry['status']}",
                  file=sys.stderr)
        else:
            print(f"note: {summary['scenario']}: configuration {entry['label']!r} {entry['status']}", file=sys.stderr)
    if subjects:
        print(f"error: the subject of {', '.join(subjects)} failed, so nothing there was measured against it; "
              f"each run's log is {out}/<scenario>/run<N>.log", file=sys.stderr)
        return 1
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """`kvforge bench serve`: every engine's server under Poisson load at each rate."""
    from kvforge.benchmarks import harness, scenarios, serve_load
    from kvforge.core import ConfigError

    if args.scenarios != ["serve"]:
        raise ConfigError(f"'serve' runs alone; got {' '.join(args.scenarios)}; run the other scenarios separately")
    try:
        rates = [float(r) for r in (args.rates or ("1,2,4" if args.quick else "0.5,1,2,4,8")).split(",")]
    except ValueError:
        raise ConfigError(f"--rates must be numbers separated by commas, got {args.rates!r}") from None
    if not rates or min(rates) <= 0:
        raise ConfigError(f"--rates must be positive, got {args.rates!r}")
    try:
        sizes = [int(n) for n in args.data_parallel_sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--data-parallel-sizes must be integers separated by commas, got "
                          f"{args.data_parallel_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--data-parallel-sizes must be >= 1, got {args.data_parallel_sizes!r}")
    peers = harness.peer_pythons(args.peer)
    kvforge_python = peers.get("kvforge") or sys.executable
    engines = {serve_load.kvforge_engine_name(n): kvforge_python for n in sizes}
    if peers.get("vllm"):
        engines["vllm"] = peers["vllm"]
    else:
        print("peer vllm not given, not run (--peer vllm=PATH/TO/python)", file=sys.stderr)
    model = args.model or (QUICK_MODEL if args.quick else FULL_MODEL)
    path = model_dir(model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    requests = scenarios.build("mixed", vocab, args.quick).requests
    if args.max_requests is not None:
        requests = requests[:args.max_requests]
    target = serve_load.LatencyTarget(args.ttft_target_ms / 1e3, args.tpot_target_ms / 1e3)
    out = Path(args.out)
    results = serve_load.bench_serve(engines, str(path), requests, rates,
                                     kv_cache_gib=args.kv_cache_gib or (0.5 if args.quick else 2.0),
                                     threads=args.threads or None, target=target, out=out,
                                     log=lambda line: print(line, file=sys.stderr))
    print(f"wrote {out / 'serve.json'}, {out / 'serve.md'} and {out / 'serve.png'}", file=sys.stderr)
    print(serve_load.markdown(results))
    kvforge_ok = all(entry.get("status") == "ok" for name, entry in results["engines"].items()
                     if name.startswith("kvforge"))
    return 0 if kvforge_ok else 1
