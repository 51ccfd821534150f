"""The `lora` scenario of `kvforge bench`: what serving LoRA adapters costs.

A `mixed`-style batch of 32 requests (greedy, `max_tokens` exactly), run on the
base model and with 1, 4 and 16 distinct adapters (request i runs adapter
i mod count), at rank 8 and 16, each adapter on every projection of every layer
(`peers/lora_adapters.py` writes them, PEFT format, random weights). kvforge also
runs with LoRA enabled but no adapter in any request: what enabling costs a base
request. vLLM's CPU build serves the same adapter files on the same prompts.
"""

from __future__ import annotations

import random

from .scenarios import Run, Scenario, Target, _ids, request

BATCH = 32
COUNTS = (1, 4, 16)
RANKS = (8, 16)
MAX_RANK = max(RANKS)


def label(peer: str, count: int, rank: int) -> str:
    return f"{peer} {count} adapters r{rank}"


def scenario(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    rng = random.Random(seed + 7)
    prompt_max, output = (64, 32) if quick else (256, 128)
    requests = [dict(request(i, _ids(rng, rng.randint(16, prompt_max), vocab), output), lora_index=i)
                for i in range(BATCH)]
    counts, ranks = ((16,), (16,)) if quick else (COUNTS, RANKS)
    scheduler = {"scheduler": {"max_num_seqs": BATCH}}
    lora = {"lora": {"max_loras": max(counts), "max_lora_rank": MAX_RANK, "max_cpu_loras": max(counts)}}
    runs = [Run("kvforge base", "kvforge", scheduler),
            Run("kvforge LoRA on, no adapter", "kvforge", {**scheduler, **lora})]
    for rank in ranks:
        runs += [Run(label("kvforge", count, rank), "kvforge",
                     {**scheduler, **lora, "lora_adapters": {"count": count, "rank": rank}}) for count in counts]
    vllm = {"max_num_seqs": BATCH, "max_loras": max(counts), "max_lora_rank": MAX_RANK}
    runs.append(Run("vLLM CPU base", "vllm", {"max_num_seqs": BATCH}))
    for rank in ranks:
        runs += [Run(label("vLLM CPU", count, rank), "vllm", {**vllm, "lora_adapters": {"count": count, "rank": rank}})
                 for count in counts]
    top = max(counts)
    subject = label("kvforge", top, MAX_RANK)
    targets = [Target(f"lora: {top} adapters at batch {BATCH} cost <= 1.3x the base model's step time",
                      subject, "kvforge base", "throughput", 1 / 1.3),
               Target(f"lora: >= 1.0x vLLM CPU with the same {top} adapters (rank {MAX_RANK})", subject,
                      label("vLLM CPU", top, MAX_RANK), "throughput", 1.0),
               Target("lora: enabling LoRA costs a base-only batch nothing (>= 0.97x)", "kvforge LoRA on, no adapter",
                      "kvforge base", "throughput", 0.97)]
    note = (f"{BATCH} requests at once, greedy, {output} output tokens each (EOS ignored); request i runs adapter "
            "i mod count; every adapter targets q, k, v, o, gate, up and down of every layer (random weights, "
            "PEFT format, the same files for both engines).")
    return Scenario("lora", requests, runs, subject, targets, note=note)
