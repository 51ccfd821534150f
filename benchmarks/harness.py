"""Run a scenario's configurations side by side, each engine in its own process
with the Python given for it, and turn their JSON into comparable figures.

    results = run_scenario(scenario, model_dir, out_dir, peers={"vllm": "~/venvs/vllm/bin/python"})

A configuration whose peer has no Python is not run, and says so; one whose
process fails is reported with the tail of its stderr.

Without `--peer`, kvforge and both transformers peers run with this Python
(transformers is a dependency of kvforge); `--peer transformers=none` turns the
transformers peers off. vLLM runs only when given its own Python.
"""

from __future__ import annotations

import ctypes.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvforge.models import heap

from . import work
from .scenarios import Scenario, Target, write_workload

PEERS_DIR = Path(__file__).resolve().parent / "peers"
RUNNERS = {"kvforge": "kvforge_peer.py", "generate": "hf_generate.py", "generate_batch": "hf_generate_batch.py",
           "vllm": "vllm_peer.py", "llama.cpp": "llama_cpp_peer.py"}
# Peers given a program rather than a Python (--peer llama.cpp=BIN_DIR): their runner runs with
# this Python and finds the program from `peer_path` in its config.
PROGRAM_PEERS = ("llama.cpp",)
ALIASES = {"transformers": ("generate", "generate_batch")}  # --peer transformers=PY sets both
# transformers is a dependency of kvforge, so its peers can run with this very Python out of the box.
DEFAULT_PEERS = ("kvforge", "generate", "generate_batch")
OFF = "none"  # --peer NAME=none: do not run NAME


def peer_pythons(pairs: list[str] | None) -> dict[str, str | None]:
    """`["vllm=/path/python", "transformers=none", ...]` as a dict of peer -> Python.

    kvforge and the transformers peers default to this Python; a peer set to
    `none` maps to None (turned off); a peer absent from the dict (vLLM unless
    given) was never given a Python. A path with a directory in it is made
    absolute; a bare name is found on PATH."""
    from kvforge.core import ConfigError

    pythons: dict[str, str | None] = {peer: sys.executable for peer in DEFAULT_PEERS}
    for pair in pairs or []:
        name, sep, path = pair.partition("=")
        if not sep or not path:
            raise ConfigError(f"--peer {pair!r}: write NAME=PATH/TO/python (e.g. vllm=~/venvs/vllm/bin/python), "
                              f"or NAME={OFF} to turn a peer off")
        names = ALIASES.get(name, (name,))
        if any(one not in RUNNERS for one in names):
            raise ConfigError(f"--peer {name!r} is not a known peer; choose from: "
                              f"{', '.join(sorted(set(RUNNERS) | set(ALIASES)))}")
        if path.lower() == OFF:
            if name == "kvforge":
                raise ConfigError(f"--peer kvforge={OFF}: kvforge is what every scenario measures and cannot be "
                                  "turned off; give kvforge=PATH/TO/python to run it with another Python")
            path = None
        elif os.sep in path:  # peers run from their output folder: a relative path must not move with them
            path = os.path.abspath(os.path.expanduser(path))
        for one in names:
            pythons[one] = path
    return pythons


def program_missing(path: str) -> str | None:
    """Why llama.cpp cannot run from `path` (its bin directory or llama-bench), or None when it can."""
    from .peers.llama_cpp_peer import locate

    try:
        locate(path)
    except ValueError as exc:
        return f"llama.cpp: {exc}"
    return None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with numpy's default linear interpolation; None for no values.
    Every latency percentile kvforge reports (bench, `kvforge generate`) is this one."""
    if not values:
        return None
    return float(np.percentile(values, q))


def failed_runs(results: dict) -> list[tuple[dict, dict]]:
    """(scenario summary, run) for every configuration that was run and failed."""
    return [(summary, run) for summary in results["scenarios"] for run in summary.get("runs", [])
            if run["status"].startswith("failed")]


def metrics(result: dict, latency_class: str | None = None, flops: float | None = None) -> dict:
    """Output tokens/s over the whole run; TTFT and TPOT percentiles over the
    requests (of `latency_class` only, when given); peak KV in MiB; with the
    run's useful `flops` (work.py), its useful GFLOP/s."""
    requests = result["requests"]
    tokens = sum(r["output_tokens"] for r in requests)
    chosen = [r for r in requests if latency_class is None or r.get("cls") == latency_class]
    ttft = [r["ttft_s"] for r in chosen if r["ttft_s"] is not None]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in chosen
            if r["output_tokens"] > 1 and r["ttft_s"] is not None and r["latency_s"] is not None]
    elapsed = result["elapsed_s"]
    peak = result.get("peak_kv_bytes")
    cpu = result.get("info", {}).get("cpu_s")  # the engine process's CPU time, where the peer records it
    return {"requests": len(requests), "output_tokens": tokens, "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "tokens_per_cpu_s": tokens / cpu if cpu else None,
            "useful_gflops": flops / elapsed / 1e9 if flops is not None and elapsed > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "peak_kv_mib": None if peak is None else peak / 2**20}


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios(runs: list[dict], subject: str) -> dict[str, dict]:
    """For every other run that ran: the subject's throughput over it (the fastest
    rounds' and, after more than one round, each round's), and the subject's
    TTFT p50 over it (below 1 is better)."""
    base = next((r for r in runs if r["label"] == subject and r["status"] == "ok"), None)
    if base is None:
        return {}
    out = {}
    for run in runs:
        if run["label"] == subject or run["status"] != "ok":
            continue
        m, s = run["metrics"], base["metrics"]
        out[run["label"]] = {"throughput": _ratio(s["tokens_per_s"], m["tokens_per_s"]),
                             # per CPU second: steadier than elapsed time where other jobs share the cores
                             "throughput_cpu": _ratio(s.get("tokens_per_cpu_s"), m.get("tokens_per_cpu_s")),
                             "ttft_p50": _ratio(s["ttft_p50_s"], m["ttft_p50_s"])}
        pairs = list(zip(base.get("rounds_tokens_per_s", []), run.get("rounds_tokens_per_s", [])))
        if len(pairs) > 1:  # round by round: how far the ratio moved with the machine's load
            out[run["label"]]["throughput_rounds"] = [_ratio(a, b) for a, b in pairs]
    return out


def scenario_targets(scenario, runs: list[dict]) -> list[dict]:
    """Each target of `scenario` checked: its own subject over its other run (a target
    may compare two runs neither of which is the scenario's subject)."""
    return [check_target(target, ratios(runs, target.subject)) for target in scenario.targets]


def check_target(target: Target, ratio_table: dict[str, dict]) -> dict:
    """Measured value of a target and whether it is met; 'not measured' when a side did not run."""
    entry = ratio_table.get(target.other)
    row = {"target": target.text, "threshold": target.threshold, "metric": target.metric}
    value = None
    if entry is not None:
        if target.metric == "throughput":
            value = entry["throughput"]
        elif target.metric == "ttft_reduction" and entry["ttft_p50"] is not None:
            value = 1 - entry["ttft_p50"]
    row["value"] = value
    row["status"] = "not measured" if value is None else ("met" if value >= target.threshold else "missed")
    return row


def tcmalloc() -> str | None:
    """The system's TCMalloc (its minimal build) by library name, or None where it is not installed."""
    return ctypes.util.find_library("tcmalloc_minimal")


def allocator_note(peers: dict[str, str | None]) -> str | None:
    """What the vLLM peer allocates with, for the report; None when vLLM does not run."""
    if not peers.get("vllm"):
        return None
    if tcmalloc() is not None:
        return "vLLM runs with TCMalloc preloaded, as its CPU guide sets it up."
    return ("vLLM runs on glibc malloc (with kvforge's settings): TCMalloc, which its CPU guide preloads, is not "
            "installed here (`apt install libtcmalloc-minimal4`), and vLLM is slower without it (docs/benchmarks.md, "
            "Memory allocator).")


def peer_env(peer: str, kv_cache_gib: float, threads: int | None) -> dict:
    """The environment of a peer process. Every peer gets the same OpenMP thread
    count: on a small shared machine, spin-waiting OpenMP threads that outnumber
    the free cores make a run many times slower and its figures noise."""
    env = dict(os.environ)
    # The glibc malloc settings the kvforge engine applies to itself, for every
    # engine alike (vLLM's CPU guide suggests tcmalloc for the same reason).
    for key, value in heap.ENV.items():
        env.setdefault(key, value)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if peer == "vllm":
        # vLLM's CPU guide preloads TCMalloc, and vLLM preloads it into the worker
        # processes it starts; run in-process, as here, nothing would.
        library, preload = tcmalloc(), env.get("LD_PRELOAD", "")
        if library and "tcmalloc" not in preload:
            env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
        env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_one(python: str, peer: str, workload: Path, config: dict, out: Path, timeout: float, kv_cache_gib: float,
            threads: int | None = None) -> dict:
    """Run one configuration in its own process; its result JSON, or a status saying why not."""
    # The process runs from out's folder: every path it is given must name the same file from there.
    workload, out = Path(workload).absolute(), Path(out).absolute()
    config_file = out.with_suffix(".config.json")
    config_file.write_text(json.dumps(config))
    command = [python, str(PEERS_DIR / RUNNERS[peer]), "--workload", str(workload), "--config", str(config_file),
               "--out", str(out)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=peer_env(peer, kv_cache_gib, threads),
                              cwd=str(out.parent))
    except FileNotFoundError:
        return {"status": f"failed: no Python at {python}"}
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timed out after {timeout:.0f} s"}
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode < 0:
        return {"status": f"failed: killed by signal {-proc.returncode} (log: {out.with_suffix('.log').name})"}
    if proc.returncode != 0 or not out.is_file():
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        return {"status": f"failed (exit {proc.returncode}): {lines[-1][-200:]} (log: {out.with_suffix('.log').name})"}
    return {"status": "ok", "result": json.loads(out.read_text())}


def same_output(pair: tuple[str, str], outcomes: dict[str, dict]) -> dict:
    """Whether the two runs of `pair` (labels) generated the same tokens for every request:
    `identical`, `differ` (with the differing request ids), `not measured` when either did
    not run, `not recorded` when either kept no tokens."""
    row = {"runs": list(pair)}
    first, second = (outcomes.get(label) for label in pair)
    if first is None or second is None or first["status"] != "ok" or second["status"] != "ok":
        return {**row, "status": "not measured"}
    tokens = [{r["id"]: r.get("token_ids") for r in o["result"]["requests"]} for o in (first, second)]
    if any(ids is None for run in tokens for ids in run.values()):
        return {**row, "status": "not recorded"}
    differing = sorted(i for i, ids in tokens[0].items() if ids != tokens[1].get(i))
    return {**row, "status": "differ" if differing else "identical", "requests": len(tokens[0]),
            "differing": differing}


def fastest(outcomes: list[dict]) -> dict:
    """The outcome with the shortest elapsed time (the least disturbed by other
    load), or the first failure."""
    failed = next((o for o in outcomes if o["status"] != "ok"), None)
    return failed or min(outcomes, key=lambda o: o["result"]["elapsed_s"])


def run_scenario(scenario: Scenario, model_dir: str, out_dir: Path, *, peers: dict[str, str], dtype: str = "float32",
                 kv_cache_gib: float = 1.0, timeout: float = 1800, threads: int | None = 1, repeats: int = 1,
                 log=print) -> dict:
    """Every configuration of `scenario` on one workload, `repeats` rounds of
    them in turn, each configuration's figures from its fastest round; the
    scenario's results as a dict."""
    summary = {"scenario": scenario.name, "subject": scenario.subject, "latency_class": scenario.latency_class,
               "runs": [], "ratios": {}, "targets": [], "note": scenario.note}
    if scenario.unavailable:
        summary["status"] = scenario.unavailable
        return summary
    out_dir = Path(out_dir) / scenario.name
    # peers read the model directory from the workload, from their own folder
    model_dir = str(Path(model_dir).absolute())
    workload = write_workload(scenario, out_dir / "workload.json", model_dir=model_dir, dtype=dtype,
                              kv_cache_gib=kv_cache_gib)
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    prompt_lengths = {r["id"]: len(r["prompt_token_ids"]) for r in scenario.requests}
    started = []  # (index, run, entry, Python) of the configurations that run
    for i, run in enumerate(scenario.runs):
        entry = {"label": run.label, "peer": run.peer, "options": run.options}
        python = peers.get(run.peer)
        if run.peer not in peers:
            entry["status"] = "not run: no --peer given"
        elif python is None:
            entry["status"] = f"not run: turned off (--peer {run.peer}={OFF})"
        elif run.peer in PROGRAM_PEERS and (missing := program_missing(python)):
            entry["status"] = f"not run: {missing}"
        else:
            started.append((i, run, entry, python))
        summary["runs"].append(entry)
    # Round by round (A, B, A, B, ...), so a busy machine's drift falls on every
    # configuration alike; a configuration that fails is not run again.
    rounds = max(1, repeats)
    outcomes: dict[int, list[dict]] = {i: [] for i, *_ in started}
    for round_ in range(rounds):
        for i, run, entry, python in started:
            if any(o["status"] != "ok" for o in outcomes[i]):
                continue
            which = f" (round {round_ + 1} of {rounds})" if rounds > 1 else ""
            log(f"[{scenario.name}] {run.label}{which} ...")
            config = {"label": run.label, "options": run.options}
            if run.peer in PROGRAM_PEERS:
                python, config["peer_path"] = sys.executable, python
            outcome = run_one(python, run.peer, workload, config, out_dir / f"run{i}.json", timeout, kv_cache_gib,
                              threads)
            outcomes[i].append(outcome)
            log(f"[{scenario.name}] {run.label}{which}: {outcome['status']}")
    for i, run, entry, python in started:
        outcome = fastest(outcomes[i])
        entry["status"] = outcome["status"]
        if "result" in outcome:
            records = outcome["result"]["requests"]
            flops = work.run_flops(hf_config, prompt_lengths, records) if work.counts(hf_config) else None
            entry["metrics"] = metrics(outcome["result"], scenario.latency_class, flops)
            classes = sorted({r.get("cls") for r in records if r.get("cls") is not None})
            if len(classes) > 1:  # TTFT/TPOT of each request class (the scenario's figures may compare them)
                entry["metrics_by_class"] = {cls: metrics(outcome["result"], cls) for cls in classes}
            entry["info"] = outcome["result"].get("info", {})
            entry["rounds_tokens_per_s"] = [metrics(o["result"])["tokens_per_s"] for o in outcomes[i]]
    summary["ratios"] = ratios(summary["runs"], scenario.subject)
    summary["targets"] = scenario_targets(scenario, summary["runs"])
    if scenario.same_output is not None:
        by_label = {run.label: fastest(outcomes[i]) for i, run, *_ in started}
        summary["same_output"] = same_output(scenario.same_output, by_label)
    summary["status"] = "ok"
    return summary
