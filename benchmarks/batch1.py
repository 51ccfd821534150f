"""The `batch1` scenario of `kvforge bench`: one sequence at a time, kvforge
beside llama.cpp, per weight format.

* kvforge runs its engine on requests one after another (each arrives long
  after the previous one finished, so every step holds one sequence), in
  float32, bfloat16, and with `int8_weight` weights: weight-only (under
  float32 activations, and under bfloat16) and W8A8:
  a few "prompt" requests, a P-token prompt then N + 1 generated tokens, and
  as many "tg" requests, a one-token prompt then N + 1 generated tokens
  (greedy, EOS ignored). Prefill tok/s is P over a prompt request's TTFT;
  tg tok/s is one over a tg request's time per output token after the first
  (N decode steps from an almost empty context); tg after P is the same over
  a prompt request (N decode steps attending to P..P+N positions).
* llama.cpp (`--peer llama.cpp=BIN_DIR`, peers/llama_cpp_peer.py) converts the
  same model to GGUF f32, bf16 and Q8_0 with its own converter and runs
  `llama-bench -p P -n N` (its pp test, and its tg test from an empty
  context) and `llama-bench -p 0 -n N -d P` (tg after a P-token context).
* Each kvforge run runs twice: as configured by default (multi-step decoding:
  the scheduling, result and output work paid once per burst of up to
  `scheduler.num_scheduler_steps` decode passes within `scheduler.max_burst_s`;
  greedy bursts run as one C++ call), and with every step scheduled
  (`num_scheduler_steps = 1`).
* After the runs (`figures`): each pair's ratios, kvforge over llama.cpp,
  like for like (tg against tg, tg after P against tg after P), and the
  targets: tg >= 1.0x llama.cpp per format (stretch: 1.2x), prefill >= 1.5x,
  for both kinds of kvforge run.
* Memory: each engine's peak resident memory (kvforge's process, loading
  included, and its resident memory after the runs; llama-bench's `-p P -n N`
  process), kvforge's KV cache sized to `KV_TOKENS` float32 tokens.
* Start-up: from launching each engine's process to the first token of a
  short prompt (`info.startup_s` of both peers).

P, N = 512, 128 (`--quick`: 64, 16). The default model is `bench-llama-25m`
(model_dirs.py); `--model` picks another.
"""

from __future__ import annotations

import os
import random

from .scenarios import Run, Scenario, _ids, request

MODEL = "bench-llama-25m"
# The KV cache of each kvforge run: room for this many float32 tokens (twice as many in
# bfloat16), so that its resident memory compares with llama-bench's, whose context holds
# the P + N tokens of its test (not the harness's --kv-cache-gib budget, which it fills).
KV_TOKENS = 1024
NO_PREFIX_CACHE = {"cache": {"enable_prefix_caching": False}, "kv_tokens_float32": KV_TOKENS}
INT8 = {"weights": "int8_weight"}
# label -> options of each kvforge run
KVFORGE = {
    "kvforge float32": {**NO_PREFIX_CACHE, "dtype": "float32"},
    "kvforge bfloat16": {**NO_PREFIX_CACHE, "dtype": "bfloat16"},
    "kvforge int8_weight": {**NO_PREFIX_CACHE, "dtype": "float32",
                            "quantization": {**INT8, "activations": "none"}},
    "kvforge int8_weight W8A8": {**NO_PREFIX_CACHE, "dtype": "float32",
                                 "quantization": {**INT8, "activations": "int8"}},
    # Weight-only int8 under bfloat16 activations: on a CPU with a bfloat16 dot product
    # (AVX-512 BF16) its prefill multiplies bfloat16 pairs, not float32.
    "kvforge int8_weight bfloat16": {**NO_PREFIX_CACHE, "dtype": "bfloat16",
                                     "quantization": {**INT8, "activations": "none"}},
}
LLAMA_CPP = {"llama.cpp f32": "f32", "llama.cpp bf16": "bf16", "llama.cpp Q8_0": "q8_0"}
# weight format -> (kvforge run, llama.cpp run) compared
PAIRS = {
    "float32": ("kvforge float32", "llama.cpp f32"),
    "bfloat16": ("kvforge bfloat16", "llama.cpp bf16"),
    "int8 weight-only": ("kvforge int8_weight", "llama.cpp Q8_0"),
    "int8 W8A8": ("kvforge int8_weight W8A8", "llama.cpp Q8_0"),
    "int8 weight-only, bfloat16 activations": ("kvforge int8_weight bfloat16", "llama.cpp Q8_0"),
}
# Each run again without multi-step decoding (docs/engine.md): every decode step scheduled.
STEPPED = ", every step scheduled"
for _label, _options in list(KVFORGE.items()):
    KVFORGE[_label + STEPPED] = {**_options, "scheduler": {"num_scheduler_steps": 1}}
for _fmt, (_ours, _theirs) in list(PAIRS.items()):
    PAIRS[_fmt + STEPPED] = (_ours + STEPPED, _theirs)
DECODE_TARGET, DECODE_STRETCH, PREFILL_TARGET = 1.0, 1.2, 1.5
PROMPT, TG = "prompt", "tg"  # the request classes: a P-token prompt; a one-token prompt (decode from empty)
BATCHED_SEQUENCES = [1, 4]  # llama-batched-bench's parallel sequence counts, beside llama-bench


def sizes(quick: bool) -> tuple[int, int, int]:
    """(prompt tokens, decode tokens after the first, requests)."""
    return (64, 16, 2) if quick else (512, 128, 3)


def scenario(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    from .model_dirs import SYNTHETIC

    # ids every model it may run can read: `vocab` is the default model's, which MODEL replaces
    vocab = min(vocab, SYNTHETIC[MODEL]["vocab_size"])
    rng = random.Random(seed + 8)
    prompt, decode, count = sizes(quick)
    # Far enough apart that each arrives after the previous one finished (prefill takes at most
    # `prompt` steps), so every step runs batch 1; the engine idles in between.
    spacing = prompt + decode + 8
    requests = [request(i, _ids(rng, prompt, vocab), decode + 1, arrival_step=i * spacing, cls=PROMPT)
                for i in range(count)]
    requests += [request(count + i, _ids(rng, 1, vocab), decode + 1, arrival_step=count * spacing
                         + i * (decode + 8), cls=TG) for i in range(count)]
    runs = [Run(label, "kvforge", options) for label, options in KVFORGE.items()]
    runs += [Run(label, "llama.cpp", {"outtype": outtype, **({} if quick else {"batched": BATCHED_SEQUENCES})})
             for label, outtype in LLAMA_CPP.items()]
    note = (f"One sequence at a time: {count} requests one after another, each a {prompt}-token prompt and "
            f"{decode + 1} generated tokens, then {count} with a one-token prompt and {decode + 1} generated "
            f"tokens (greedy, EOS ignored), prefix caching off; llama.cpp runs `llama-bench -p {prompt} -n "
            f"{decode}` and `-p 0 -n {decode} -d {prompt}` on the model converted by its own converter.")
    return Scenario("batch1", requests, runs, "kvforge float32", latency_class=PROMPT, note=note,
                    default_model=None if quick else MODEL,
                    figures=lambda summary, out_dir, model_dir: figures(summary, prompt))


def _per_token(m: dict | None) -> float | None:
    return 1 / m["tpot_p50_s"] if m and m.get("tpot_p50_s") else None


def speeds(run: dict, prompt: int) -> dict | None:
    """A run's prefill tok/s (P over the prompt requests' TTFT p50), tg tok/s (decode from an empty context)
    and tg tok/s after P (decode after a P-token prompt), each one over a TPOT p50; None when it did not run.
    kvforge's tg is its tg requests'; llama.cpp's is llama-bench's tg test, its tg after P the `-d P` test's."""
    m = run.get("metrics")
    if not m or not m.get("ttft_p50_s") or not m.get("tpot_p50_s"):
        return None
    info = run.get("info", {})
    if run["peer"] == "llama.cpp":
        tg, after = _per_token(m), info.get("tg_after_prompt_tps")
    else:
        tg, after = _per_token(run.get("metrics_by_class", {}).get(TG)), _per_token(m)
    process = {key: info[key] for key in ("peak_rss_bytes", "rss_bytes", "kv_cache_bytes", "startup_s") if info.get(key)}
    return {"prefill_tps": prompt / m["ttft_p50_s"], "tg_tps": tg, "tg_after_prompt_tps": after, **process}


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


def target_row(text: str, value: float | None, threshold: float) -> dict:
    status = "not measured" if value is None else ("met" if value >= threshold else "missed")
    return {"target": text, "metric": "throughput", "value": value, "threshold": threshold, "status": status}


def figures(summary: dict, prompt: int) -> dict:
    """Each run's speeds, each pair's ratios, and the targets (added to the summary's)."""
    by_label = {run["label"]: run for run in summary["runs"]}
    runs = {label: speeds(run, prompt) for label, run in by_label.items()}
    clocks = {label: ("wall" if run["peer"] == "llama.cpp" else os.environ.get("KVFORGE_BENCH_CLOCK", "wall"))
              for label, run in by_label.items()}
    pairs, targets = {}, list(summary.get("targets", []))
    for fmt, (ours, theirs) in PAIRS.items():
        a, b = runs.get(ours), runs.get(theirs)
        decode, prefill = _ratio(a, b, "tg_tps"), _ratio(a, b, "prefill_tps")
        pairs[fmt] = {"kvforge": ours, "llama.cpp": theirs, "decode": decode, "prefill": prefill,
                      "decode_after_prompt": _ratio(a, b, "tg_after_prompt_tps"),
                      "peak_memory": _ratio(a, b, "peak_rss_bytes"), "startup": _ratio(a, b, "startup_s")}
        targets += [target_row(f"batch1 {fmt}: tg >= {DECODE_TARGET:.1f}x {theirs}", decode, DECODE_TARGET),
                    target_row(f"batch1 {fmt}: tg >= {DECODE_STRETCH:.1f}x {theirs} (stretch)", decode,
                               DECODE_STRETCH),
                    target_row(f"batch1 {fmt}: prefill >= {PREFILL_TARGET:.1f}x {theirs}", prefill, PREFILL_TARGET)]
    batched = {label: run["info"].get("batched") for label, run in by_label.items()
               if run.get("info", {}).get("batched") is not None}
    return {"batch1": {"prompt": prompt, "runs": runs, "clocks": clocks, "pairs": pairs, "batched": batched},
            "model_reason": "the scenario's own: the 24.65M Llama it compares with llama.cpp on",
            "targets": targets}


def _num(value, fmt="{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(figures: dict) -> list[str]:
    runs, clocks, p = figures["runs"], figures["clocks"], figures["prompt"]
    lines = [f"| weight format | kvforge run | prefill tok/s | tg tok/s | tg after {p} | llama.cpp run | pp tok/s "
             f"| tg tok/s | tg after {p} | prefill × | tg × | tg after {p} × |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, pair in figures["pairs"].items():
        a, b = runs.get(pair["kvforge"]) or {}, runs.get(pair["llama.cpp"]) or {}
        lines.append(f"| {fmt} | {pair['kvforge']} | {_num(a.get('prefill_tps'))} | {_num(a.get('tg_tps'))} "
                     f"| {_num(a.get('tg_after_prompt_tps'))} | {pair['llama.cpp']} | {_num(b.get('prefill_tps'))} "
                     f"| {_num(b.get('tg_tps'))} | {_num(b.get('tg_after_prompt_tps'))} "
                     f"| {_num(pair['prefill'], '{:.2f}')} | {_num(pair['decode'], '{:.2f}')} "
                     f"| {_num(pair.get('decode_after_prompt'), '{:.2f}')} |")
    used = sorted({clocks[label] for label, speed in runs.items() if speed})
    clock = (f"clock: {used[0]} time on every run" if len(used) == 1 else
             "clocks: " + ", ".join(f"{label} {clocks[label]}" for label in runs if runs[label])
             + " (mixed: llama-bench times wall clock only; run with KVFORGE_BENCH_CLOCK unset to compare)")
    lines += ["", f"Medians over the requests (kvforge) and llama-bench's repetitions (llama.cpp); {clock}.", ""]
    lines += [f"tg: decode from an empty context (llama-bench's tg; kvforge's one-token prompts); tg after {p}: "
              f"decode after a {p}-token context (llama-bench `-d {p}`; kvforge's {p}-token prompts). The targets "
              "take tg.", ""]
    lines += memory_markdown(figures)
    for label, rows in figures.get("batched", {}).items():
        if isinstance(rows, str):
            lines += [f"{label} llama-batched-bench: {rows}", ""]
            continue
        lines += [f"{label}, llama-batched-bench: " + "; ".join(
            f"{row.get('pl')} at once: prompt {_num(row.get('speed_pp'))} tok/s, decode {_num(row.get('speed_tg'))} tok/s"
            for row in rows), ""]
    return lines


def _mb(value) -> str:
    return _num(value / 1e6 if value else None, "{:,.0f}")


def memory_markdown(figures: dict) -> list[str]:
    """Peak resident memory and start-up side by side, per weight format (the every-step runs load alike)."""
    runs = figures["runs"]
    lines = ["| weight format | kvforge peak MB | kvforge after the runs MB | its KV cache MB | llama.cpp peak MB "
             "| peak × | kvforge start-up s | llama.cpp start-up s | start-up × |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fmt, pair in figures["pairs"].items():
        if fmt.endswith(STEPPED):
            continue
        a, b = runs.get(pair["kvforge"]) or {}, runs.get(pair["llama.cpp"]) or {}
        lines.append(f"| {fmt} | {_mb(a.get('peak_rss_bytes'))} | {_mb(a.get('rss_bytes'))} "
                     f"| {_mb(a.get('kv_cache_bytes'))} | {_mb(b.get('peak_rss_bytes'))} "
                     f"| {_num(pair.get('peak_memory'), '{:.2f}')} | {_num(a.get('startup_s'), '{:.2f}')} "
                     f"| {_num(b.get('startup_s'), '{:.2f}')} | {_num(pair.get('startup'), '{:.1f}')} |")
    return lines + ["", "Resident memory (RSS) of each engine's process: kvforge's peak includes loading the "
                    f"checkpoint and the Python runtime with torch; its KV cache holds {KV_TOKENS} float32 tokens; "
                    "llama.cpp's is llama-bench's `-p P -n N` run, with the context that test needs. Start-up: "
                    "from launching the process to the first token of a short prompt (kvforge: the interpreter, "
                    "its imports, loading and the first step; llama.cpp: llama-bench to its exit after a short pp "
                    "and a one-token tg test, no warm-up); the model files in the page cache. × is kvforge's over "
                    "llama.cpp's: lower is better for both.", ""]
