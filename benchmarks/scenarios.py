"""The end-to-end scenarios of `kvforge bench`: each is a workload (token ids and
per-request output lengths drawn from a fixed seed, written once to JSON) and the
configurations that run it side by side.

A workload request: `id`, `prompt_token_ids`, `max_tokens` (generated exactly,
greedy, EOS ignored), `priority` (lower runs first), `arrival_step` (the kvforge
engine step before which it is added; peers add everything at once) and `cls`
(a class whose latency is reported on its own, e.g. "high").
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.core import QUANTIZER, SPECULATIVE_PROPOSER

NAMES = ("mixed", "prefix", "speculative", "priority", "kv-quant", "long-prompt", "structured", "lora", "batch1")


@dataclass
class Run:
    """One configuration of a scenario: which peer runs it, and its options."""

    label: str
    peer: str  # kvforge | generate | generate_batch | vllm | llama.cpp
    options: dict = field(default_factory=dict)


@dataclass
class Target:
    """`subject` against `other` on `metric` must reach `threshold` (see report.py)."""

    text: str
    subject: str
    other: str
    metric: str  # "throughput" (ratio) or "ttft_reduction" (1 - ratio of TTFT p50)
    threshold: float


@dataclass
class Scenario:
    name: str
    requests: list[dict]
    runs: list[Run]
    subject: str  # the run every other run is compared with
    targets: list[Target] = field(default_factory=list)
    latency_class: str | None = None  # TTFT/TPOT columns show this class only
    unavailable: str | None = None  # why the scenario cannot run here
    # The default model when its own does not hold the longest request (see model_dirs.SYNTHETIC).
    model: str | None = None
    # The model it runs instead of the default full-size bench model (when --model is not given).
    default_model: str | None = None
    note: str | None = None  # said under the scenario's heading in the report
    prefill_figures: bool = False  # the report adds the prefill attention kernel's GFLOP/s on its shapes
    # after its runs: (summary, the scenario's output folder, its model directory) -> entries added to the summary
    figures: Callable[[dict, Path, Path], dict] | None = None
    # (run, other run) whose greedy tokens must be identical: both record them (`keep_token_ids`)
    same_output: tuple[str, str] | None = None

    def longest(self) -> int:
        """Positions the longest request needs: its prompt and every generated token."""
        return max((len(r["prompt_token_ids"]) + r["max_tokens"] for r in self.requests), default=0)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # ids 3.. skip the tokenizer's special tokens (pad, bos, eos)
    return [rng.randrange(3, vocab) for _ in range(n)]


def request(i: int, prompt: list[int], max_tokens: int, priority: int = 0, arrival_step: int = 0,
             cls: str | None = None) -> dict:
    return {"id": f"r{i}", "prompt_token_ids": prompt, "max_tokens": max_tokens, "priority": priority,
            "arrival_step": arrival_step, "cls": cls}


VLLM = "vLLM CPU"
VLLM_KVFORGE = "vLLM CPU + kvforge cpp"  # vLLM with its attention on kvforge's cpp backend (kvforge.vllm_plugin)


def vllm_runs(options: dict) -> list[Run]:
    """Stock vLLM, and vLLM with kvforge's cpp attention, both recording their tokens."""
    options = {**options, "keep_token_ids": True}
    return [Run(VLLM, "vllm", options), Run(VLLM_KVFORGE, "vllm", {**options, "kvforge_attention_backend": "cpp"})]


def mixed(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    rng = random.Random(seed)
    n, prompt_max, output_max = (32, 128, 64) if quick else (256, 512, 512)
    requests = [request(i, _ids(rng, rng.randint(16, prompt_max), vocab), rng.randint(16, output_max))
                for i in range(n)]
    runs = [Run("kvforge", "kvforge"), Run("transformers generate", "generate"),
            Run("transformers generate_batch", "generate_batch"), *vllm_runs({})]
    targets = [Target("mixed: >= 1.0x vLLM CPU output tokens/s", "kvforge", "vLLM CPU", "throughput", 1.0),
               Target("mixed: >= 3x transformers generate", "kvforge", "transformers generate", "throughput", 3.0),
               Target("mixed: >= 5x transformers generate_batch", "kvforge", "transformers generate_batch",
                      "throughput", 5.0)]
    return Scenario("mixed", requests, runs, "kvforge", targets, same_output=(VLLM_KVFORGE, VLLM))


def prefix(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    rng = random.Random(seed + 1)
    n, system_len, output = (16, 256, 16) if quick else (64, 512, 32)
    system = _ids(rng, system_len, vocab)
    requests = [request(i, system + _ids(rng, rng.randint(16, 64), vocab), output) for i in range(n)]
    on = Run("prefix caching on", "kvforge", {"cache": {"enable_prefix_caching": True}})
    off = Run("prefix caching off", "kvforge", {"cache": {"enable_prefix_caching": False}})
    targets = [Target("prefix: >= 2.4x throughput, caching on vs off", on.label, off.label, "throughput", 2.4),
               Target("prefix: >= 50% lower TTFT p50, on vs off", on.label, off.label, "ttft_reduction", 0.5)]
    return Scenario("prefix", requests, [on, off], on.label, targets)


def priority(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    """Low-priority background requests fill the engine (few slots); high-priority
    ones arrive every few steps. Reported: the high class's latency."""
    rng = random.Random(seed + 2)
    background, high, every = (24, 6, 6) if quick else (64, 16, 8)
    out_max = 64 if quick else 128
    requests = [request(i, _ids(rng, rng.randint(64, 256), vocab), rng.randint(32, out_max), priority=1, cls="low")
                for i in range(background)]
    requests += [request(background + j, _ids(rng, rng.randint(32, 64), vocab), 32, priority=0,
                          arrival_step=(j + 1) * every, cls="high") for j in range(high)]
    scheduler = {"max_num_seqs": 8}
    runs = [Run("priority", "kvforge", {"scheduler": {**scheduler, "policy": "priority"}}),
            Run("fcfs", "kvforge", {"scheduler": {**scheduler, "policy": "fcfs"}})]
    return Scenario("priority", requests, runs, "priority", latency_class="high")


def long_prompt(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    """Prefill-bound: prompts of 1-4k tokens (512-2k quick), few output tokens,
    prefix caching off in every engine, so each prompt is computed in full (the
    random prompts share no prefix anyway; off makes it certain for every engine)."""
    rng = random.Random(seed + 4)
    n, prompt_min, prompt_max, output = (8, 512, 2048, 8) if quick else (32, 1024, 4096, 32)
    requests = [request(i, _ids(rng, rng.randint(prompt_min, prompt_max), vocab), output) for i in range(n)]
    runs = [Run("kvforge", "kvforge", {"cache": {"enable_prefix_caching": False}}),
            *vllm_runs({"enable_prefix_caching": False})]
    targets = [Target("long-prompt: >= 1.2x vLLM CPU output tokens/s", "kvforge", VLLM, "throughput", 1.2),
               Target("long-prompt: vLLM with kvforge cpp attention >= 1.0x stock vLLM CPU", VLLM_KVFORGE, VLLM,
                      "throughput", 1.0)]
    return Scenario("long-prompt", requests, runs, "kvforge", targets, same_output=(VLLM_KVFORGE, VLLM),
                    model="bench-llama-tiny-8k" if quick else "bench-llama-50m-8k", prefill_figures=True,
                    note="Prefix caching off in every engine; prompts of "
                         f"{prompt_min}-{prompt_max} tokens, {output} output tokens each.")


def plugin_slot(name: str, kind: str, config_path: str, requests: list[dict]) -> Scenario:
    """`speculative` / `kv-quant`: every registered implementation of `kind`
    against none; unavailable while the registry holds none."""
    from kvforge.core import build_registry

    names = [r.name for r in build_registry().implementations(kind) if r.availability().ok]
    if not names:
        return Scenario(name, [], [], "none", unavailable=f"not available: needs a {kind} plugin")
    section, key = config_path.split(".")
    runs = [Run("none", "kvforge")] + [Run(impl, "kvforge", {section: {key: impl}}) for impl in names]
    return Scenario(name, requests, runs, "none")


def kv_quant(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    """The first `mixed` requests under a KV budget that holds a quarter of their
    tokens in float32, so float32 KV preempts and recomputes; every KV quantizer
    gets the same bytes (`kv_tokens_float32`: the budget in float32 tokens)."""
    from kvforge.core import PER_TOKEN, build_registry

    requests = mixed(vocab, quick, seed).requests[:32 if quick else 64]
    demand = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    budget = {"kv_tokens_float32": demand // 4}
    found = sorted((r for r in build_registry().implementations(QUANTIZER)
                    if r.availability().ok and r.cls.granularity == PER_TOKEN), key=lambda r: -r.cls.priority)
    if not found:
        return Scenario("kv-quant", [], [], "none", unavailable="not available: needs a per-token quantizer plugin")
    runs = [Run(f"{r.name} KV", "kvforge", {**budget, "cache": {"kv_cache_dtype": r.name}}) for r in found]
    runs.append(Run("float32 KV", "kvforge", budget))
    subject = runs[0].label  # the preferred quantizer; the comparison table shows it against each other run
    target = Target(f"kv-quant: {subject} beats float32 KV where memory binds", subject, "float32 KV", "throughput", 1.0)
    return Scenario("kv-quant", requests, runs, subject, [target])


def repetitive(vocab: int, quick: bool, seed: int = 0) -> list[dict]:
    """Prompts repeating a 16-token motif: what n-gram drafting feeds on."""
    rng = random.Random(seed + 3)
    n, output = (8, 32) if quick else (64, 128)
    motif = _ids(rng, 16, vocab)
    return [request(i, motif * rng.randint(2, 8), output) for i in range(n)]


def build(name: str, vocab: int, quick: bool, seed: int = 0) -> Scenario:
    """The scenario `name` for a model with `vocab` tokens."""
    if name == "mixed":
        return mixed(vocab, quick, seed)
    if name == "prefix":
        return prefix(vocab, quick, seed)
    if name == "priority":
        return priority(vocab, quick, seed)
    if name == "speculative":
        return plugin_slot(name, SPECULATIVE_PROPOSER, "speculative.proposer", repetitive(vocab, quick, seed))
    if name == "kv-quant":
        return kv_quant(vocab, quick, seed)
    if name == "long-prompt":
        return long_prompt(vocab, quick, seed)
    if name == "structured":
        from .structured import scenario

        return scenario(vocab, quick, seed)
    if name == "lora":
        from .lora import scenario as lora_scenario

        return lora_scenario(vocab, quick, seed)
    if name == "batch1":
        from .batch1 import scenario as batch1_scenario

        return batch1_scenario(vocab, quick, seed)
    from kvforge.core import ConfigError

    raise ConfigError(f"unknown scenario {name!r}; choose from: {', '.join(NAMES)}")


def write_workload(scenario: Scenario, path: Path, *, model_dir: str, dtype: str, kv_cache_gib: float) -> Path:
    """The workload file every peer reads: written once, so all see the same tokens."""
    data = {"scenario": scenario.name, "model_dir": model_dir, "dtype": dtype, "kv_cache_gib": kv_cache_gib,
            "requests": scenario.requests}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
