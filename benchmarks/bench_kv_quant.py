"""Quantized KV cache figures, every KV quantizer against float KV on the same
model, measured side by side in one run:

* memory: KV bytes per token (scales included) against float32 and bfloat16,
  and how many `mixed` requests fit one KV budget;
* quality: teacher-forced next-token agreement over the tokens float KV
  generates greedily, the mean KL divergence KL(float || quantized) of those
  next-token distributions, and how many leading tokens free-running greedy
  decoding keeps identical.

Teacher forcing scores every position of one sequence in one forward pass over
the quantized cache (keys are written before attention reads them, so each
position attends to quantized keys exactly as a decode would), and one early
disagreement does not decide every later position.

    python -m kvforge.benchmarks.bench_kv_quant --model kvforge-tiny --model bench-llama-50m
    pytest benchmarks/bench_kv_quant.py --benchmark-only
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from kvforge.core import QUANTIZER, build_registry, cdiv

FLOAT_KV = ("float32", "bfloat16")
BUDGET_BYTES = 2**30
CODE_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "The quick brown fox jumps over the lazy dog. ",
    "for i in range(10):\n    print(i)\n",
    "# Read a file and count its lines\nwith open(path) as f:\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "Once upon a time, there was a little ",
]


CALIBRATED = "@calibrated"


def kv_quantizers() -> list[str]:
    """Every available quantizer the KV cache can use, by name; a static-scale one twice:
    with `cache.kv_scales = 1.0` (vLLM's default) and `"calibrate"` (NAME@calibrated)."""
    found = []
    for r in build_registry().implementations(QUANTIZER):
        if r.availability().ok and r.cls.kv_capable():
            found += [r.name, r.name + CALIBRATED] if r.cls.static_scale else [r.name]
    return found


def engine_for(model: str, kv_cache_dtype: str = "auto", dtype: str = "float32", num_blocks: int | None = None):
    """An engine with `kv_cache_dtype` (NAME@calibrated: a static-scale quantizer calibrated per layer)."""
    from kvforge import LLMEngine
    from kvforge.core import load_config

    kv_cache_dtype, calibrated, _ = kv_cache_dtype.partition(CALIBRATED)
    cache = {"kv_cache_dtype": kv_cache_dtype, "enable_prefix_caching": False,
             "kv_scales": "calibrate" if calibrated else 1.0}
    cache.update({"num_blocks": num_blocks} if num_blocks else {"memory_budget": 2**28})
    return LLMEngine(load_config(model=model, device="cpu", dtype=dtype, cache=cache).config)


def memory_table(model: str, mean_request_tokens: float) -> list[dict]:
    """Bytes per token and requests per `BUDGET_BYTES` for float32, bfloat16 and every KV quantizer."""
    from kvforge.engine.cache_sizing import num_blocks_for

    rows = []
    for kv in (*FLOAT_KV, *kv_quantizers()):
        engine = engine_for(model, kv_cache_dtype=kv, dtype="bfloat16" if kv == "bfloat16" else "float32",
                            num_blocks=1)
        spec = engine.model.kv_cache_spec(engine.kv.block_size)
        blocks = num_blocks_for(engine.config.cache.model_copy(update={"num_blocks": None,
                                                                         "memory_budget": BUDGET_BYTES}), spec)
        per_request = cdiv(int(mean_request_tokens), spec.block_size)
        rows.append({"kv": kv, "bytes_per_token": spec.bytes_per_block() / spec.block_size,
                     "blocks_per_gib": blocks, "requests_per_gib": blocks // per_request})
    base = {r["kv"]: r["bytes_per_token"] for r in rows}
    for row in rows:
        row["vs_float32"] = base["float32"] / row["bytes_per_token"]
        row["vs_bfloat16"] = base["bfloat16"] / row["bytes_per_token"]
    return rows


def prompts_for(engine, count: int, text: bool, seed: int = 0) -> list[list[int]]:
    """Code and prose prompts for a trained model (`text`); random ids for one with random weights."""
    if text:
        return [list(engine.tokenizer.encode(t)) for t in (CODE_PROMPTS * count)[:count]]
    rng = random.Random(seed)
    vocab = int(engine.model.vocab_size)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from kvforge import LLM, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = LLM.from_engine(engine).generate(prompt_token_ids=prompts, sampling_params=params)
    return [list(out.outputs[0].token_ids) for out in outputs]


def teacher_forced_logits(engine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits of every position of every sequence, one prefill over `engine`'s cache layout."""
    from kvforge.models.paged_driver import PagedDriver

    driver = PagedDriver(engine.model, engine.kv.block_size, len(sequences), max(len(s) for s in sequences))
    return driver.step(sequences)


def quality(model: str, kv: str, prompts_count: int = 8, tokens: int = 64, text: bool = False) -> dict:
    """Agreement, KL and identical prefix of `kv` against float32 KV on `model`."""
    float_engine = engine_for(model)
    quant_engine = engine_for(model, kv_cache_dtype=kv)
    prompts = prompts_for(float_engine, prompts_count, text)
    reference = greedy(float_engine, prompts, tokens)
    # Free-running first: its first step is the prompts' prefill, which calibrates a
    # static-scale cache as serving would (teacher forcing would show it the answers).
    free = greedy(quant_engine, prompts, tokens)
    sequences = [p + r for p, r in zip(prompts, reference)]
    agree, kl, positions, top1 = 0, 0.0, 0, 0.0
    for prompt, seq, lf, lq in zip(prompts, sequences, teacher_forced_logits(float_engine, sequences),
                                   teacher_forced_logits(quant_engine, sequences)):
        rows = slice(len(prompt) - 1, len(seq) - 1)  # the positions that predicted each generated token
        pf, pq = lf[rows].log_softmax(-1).double(), lq[rows].log_softmax(-1).double()
        agree += int((pf.argmax(-1) == pq.argmax(-1)).sum())
        kl += float((pf.exp() * (pf - pq)).sum(-1).sum())
        top1 += float(pf.exp().amax(-1).sum())  # how decided the float model is: near 1/vocab, argmax flips easily
        positions += pf.shape[0]
    prefix = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), len(r)) for r, f in zip(reference, free)]
    return {"kv": kv, "model": model, "agreement": agree / positions, "mean_kl": kl / positions,
            "float_top1_probability": top1 / positions,
            "identical_prefix_mean": sum(prefix) / len(prefix), "tokens": tokens, "prompts": prompts_count}


def mean_request_tokens(vocab: int) -> float:
    from kvforge.benchmarks.scenarios import mixed

    requests = mixed(vocab, quick=False).requests
    return sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests) / len(requests)


def markdown(memory: dict[str, list[dict]], qualities: list[dict]) -> str:
    lines = ["| model | KV | bytes/token | vs float32 | vs bfloat16 | `mixed` requests per GiB |",
             "|---|---|---:|---:|---:|---:|"]
    for model, rows in memory.items():
        for r in rows:
            lines.append(f"| {model} | {r['kv']} | {r['bytes_per_token']:.0f} | {r['vs_float32']:.2f}x | "
                         f"{r['vs_bfloat16']:.2f}x | {r['requests_per_gib']} |")
    lines += ["", "| model | KV | teacher-forced agreement | mean KL (nats) | identical greedy prefix (of N) "
                  "| float top-1 probability |", "|---|---|---:|---:|---:|---:|"]
    for q in qualities:
        lines.append(f"| {q['model']} | {q['kv']} | {q['agreement']:.3f} | {q['mean_kl']:.2e} | "
                     f"{q['identical_prefix_mean']:.1f} of {q['tokens']} | {q['float_top1_probability']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from kvforge.benchmarks.model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="built-in name, local HF directory or bench-llama-50m "
                                                         "(repeatable; default: kvforge-tiny and bench-llama-50m)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    memory, qualities = {}, []
    for name in args.model or ["kvforge-tiny", "bench-llama-50m"]:
        path = str(model_dir(name))
        vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
        memory[name] = memory_table(path, mean_request_tokens(vocab))
        for kv in kv_quantizers():
            trained = name.startswith("kvforge-")  # the built-in models; bench-llama-* have random weights
            qualities.append({**quality(path, kv, args.prompts, args.tokens, text=trained), "model": name})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memory": memory, "quality": qualities}, f, indent=2)
    print(markdown(memory, qualities))


if __name__ == "__main__":
    main()


# pytest-benchmark: `pytest benchmarks/bench_kv_quant.py --benchmark-only` (BENCH_MODEL picks the model).

def _bench_model() -> str:
    import os

    from kvforge.benchmarks.model_dirs import model_dir

    return str(model_dir(os.environ.get("BENCH_MODEL", "kvforge-tiny")))


def pytest_generate_tests(metafunc):
    if "kv" in metafunc.fixturenames:
        metafunc.parametrize("kv", kv_quantizers())


def test_quality_against_float_kv(benchmark, kv):
    """Teacher-forced agreement, KL and identical prefix of `kv` (extra_info); times the whole measurement."""
    path = _bench_model()
    trained = "kvforge-tiny" in path  # the built-in models are trained; bench-llama-* have random weights
    result = benchmark.pedantic(lambda: quality(path, kv, 4, 32, text=trained), rounds=1, iterations=1)
    benchmark.extra_info.update(result)


def test_bytes_per_token(benchmark):
    path = _bench_model()
    rows = benchmark.pedantic(lambda: memory_table(path, 512.0), rounds=1, iterations=1)
    benchmark.extra_info["rows"] = rows
