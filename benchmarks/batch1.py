"""The `batch1` scenario of `kvforge bench`: one sequence at a time, kvforge
beside llama.cpp, per weight format.

* kvforge runs its engine on a few requests one after another (each arrives
  long after the previous one finished, so every step holds one sequence):
  a P-token prompt, then N + 1 generated tokens (greedy, EOS ignored), in
  float32, bfloat16, and with `int8_weight` weights, weight-only and W8A8.
  Prefill tok/s is P over the TTFT; decode tok/s is one over the time per
  output token after the first, i.e. over the N decode steps that follow the
  prompt.
* llama.cpp (`--peer llama.cpp=BIN_DIR`, peers/llama_cpp_peer.py) converts the
  same model to GGUF f32, bf16 and Q8_0 with its own converter and runs
  `llama-bench -p P -n N`: its pp and tg tests. Its tg test decodes from an
  empty context; kvforge's decode steps follow the prompt, so they attend to
  P..P+N positions (the harder case): the ratios and targets are against tg
  as llama-bench reports it, and llama.cpp's tg after a P-token context
  (`-d P`) is reported beside them.
* After the runs (`figures`): each pair's ratios, kvforge over llama.cpp, and
  the targets: decode >= 1.0x llama.cpp per format (stretch: 1.2x), prefill
  >= 1.5x.

P, N = 512, 128 (`--quick`: 64, 16). The default model is `bench-llama-25m`
(model_dirs.py); `--model` picks another.
"""

from __future__ import annotations

import os
import random

from .scenarios import Run, Scenario, _ids, request

MODEL = "bench-llama-25m"
NO_PREFIX_CACHE = {"cache": {"enable_prefix_caching": False}}
INT8 = {"weights": "int8_weight"}
# label -> options of each kvforge run
KVFORGE = {
    "kvforge float32": {**NO_PREFIX_CACHE, "dtype": "float32"},
    "kvforge bfloat16": {**NO_PREFIX_CACHE, "dtype": "bfloat16"},
    "kvforge int8_weight": {**NO_PREFIX_CACHE, "dtype": "float32",
                            "quantization": {**INT8, "activations": "none"}},
    "kvforge int8_weight W8A8": {**NO_PREFIX_CACHE, "dtype": "float32",
                                 "quantization": {**INT8, "activations": "int8"}},
}
LLAMA_CPP = {"llama.cpp f32": "f32", "llama.cpp bf16": "bf16", "llama.cpp Q8_0": "q8_0"}
# weight format -> (kvforge run, llama.cpp run) compared
PAIRS = {
    "float32": ("kvforge float32", "llama.cpp f32"),
    "bfloat16": ("kvforge bfloat16", "llama.cpp bf16"),
    "int8 weight-only": ("kvforge int8_weight", "llama.cpp Q8_0"),
    "int8 W8A8": ("kvforge int8_weight W8A8", "llama.cpp Q8_0"),
}
DECODE_TARGET, DECODE_STRETCH, PREFILL_TARGET = 1.0, 1.2, 1.5
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
    requests = [request(i, _ids(rng, prompt, vocab), decode + 1, arrival_step=i * spacing) for i in range(count)]
    runs = [Run(label, "kvforge", options) for label, options in KVFORGE.items()]
    runs += [Run(label, "llama.cpp", {"outtype": outtype, **({} if quick else {"batched": BATCHED_SEQUENCES})})
             for label, outtype in LLAMA_CPP.items()]
    note = (f"One sequence at a time: {count} requests one after another, each a {prompt}-token prompt and "
            f"{decode + 1} generated tokens (greedy, EOS ignored), prefix caching off; llama.cpp runs "
            f"`llama-bench -p {prompt} -n {decode}` on the model converted by its own converter.")
    return Scenario("batch1", requests, runs, "kvforge float32", note=note, default_model=None if quick else MODEL,
                    figures=lambda summary, out_dir, model_dir: figures(summary, prompt))


def speeds(run: dict, prompt: int) -> dict | None:
    """A run's prefill tok/s (prompt over TTFT p50) and decode tok/s (one over TPOT p50); None when it did not run."""
    m = run.get("metrics")
    if not m or not m.get("ttft_p50_s") or not m.get("tpot_p50_s"):
        return None
    return {"prefill_tps": prompt / m["ttft_p50_s"], "decode_tps": 1 / m["tpot_p50_s"]}


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return a[key] / b[key] if a and b else None


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
        decode, prefill = _ratio(a, b, "decode_tps"), _ratio(a, b, "prefill_tps")
        deep = by_label.get(theirs, {}).get("info", {}).get("tg_after_prompt_tps")
        pairs[fmt] = {"kvforge": ours, "llama.cpp": theirs, "decode": decode, "prefill": prefill,
                      "decode_after_prompt": a["decode_tps"] / deep if a and deep else None}
        targets += [target_row(f"batch1 {fmt}: decode >= {DECODE_TARGET:.1f}x {theirs}", decode, DECODE_TARGET),
                    target_row(f"batch1 {fmt}: decode >= {DECODE_STRETCH:.1f}x {theirs} (stretch)", decode,
                               DECODE_STRETCH),
                    target_row(f"batch1 {fmt}: prefill >= {PREFILL_TARGET:.1f}x {theirs}", prefill, PREFILL_TARGET)]
    batched = {label: run["info"].get("batched") for label, run in by_label.items()
               if run.get("info", {}).get("batched") is not None}
    after_prompt = {label: run["info"]["tg_after_prompt_tps"] for label, run in by_label.items()
                    if run.get("info", {}).get("tg_after_prompt_tps")}
    return {"batch1": {"prompt": prompt, "runs": runs, "clocks": clocks, "pairs": pairs, "batched": batched,
                       "tg_after_prompt": after_prompt},
            "model_reason": "the scenario's own: the 24.65M Llama it compares with llama.cpp on",
            "targets": targets}


def _num(value, fmt="{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(figures: dict) -> list[str]:
    runs, clocks = figures["runs"], figures["clocks"]
    deep = figures.get("tg_after_prompt", {})
    lines = ["| weight format | kvforge run | prefill tok/s | decode tok/s | llama.cpp run | pp tok/s | tg tok/s "
             f"| tg tok/s after {figures['prompt']} | prefill × | decode × | decode × tg after {figures['prompt']} |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, pair in figures["pairs"].items():
        a, b = runs.get(pair["kvforge"]) or {}, runs.get(pair["llama.cpp"]) or {}
        lines.append(f"| {fmt} | {pair['kvforge']} | {_num(a.get('prefill_tps'))} | {_num(a.get('decode_tps'))} "
                     f"| {pair['llama.cpp']} | {_num(b.get('prefill_tps'))} | {_num(b.get('decode_tps'))} "
                     f"| {_num(deep.get(pair['llama.cpp']))} | {_num(pair['prefill'], '{:.2f}')} "
                     f"| {_num(pair['decode'], '{:.2f}')} | {_num(pair.get('decode_after_prompt'), '{:.2f}')} |")
    used = sorted({clocks[label] for label, speed in runs.items() if speed})
    clock = (f"clock: {used[0]} time on every run" if len(used) == 1 else
             "clocks: " + ", ".join(f"{label} {clocks[label]}" for label in runs if runs[label])
             + " (mixed: llama-bench times wall clock only; run with KVFORGE_BENCH_CLOCK unset to compare)")
    lines += ["", f"Medians over the requests (kvforge) and llama-bench's repetitions (llama.cpp); {clock}.", ""]
    if deep:
        lines += [f"`tg after {figures['prompt']}`: llama-bench's tg after a {figures['prompt']}-token context "
                  f"(`-d {figures['prompt']}`), the context kvforge's decode steps see; the targets take tg as "
                  "llama-bench reports it, from an empty context.", ""]
    for label, rows in figures.get("batched", {}).items():
        if isinstance(rows, str):
            lines += [f"{label} llama-batched-bench: {rows}", ""]
            continue
        lines += [f"{label}, llama-batched-bench: " + "; ".join(
            f"{row.get('pl')} at once: prompt {_num(row.get('speed_pp'))} tok/s, decode {_num(row.get('speed_tg'))} tok/s"
            for row in rows), ""]
    return lines

