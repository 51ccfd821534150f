"""End-to-end greedy generation with every attention backend that runs on a
device, against the `reference` backend on the same device: the check that a
backend which passes the kernel conformance grid also generates the same text
inside the engine (chunked prefill, decode, prefix caching, quantized KV).

    python -m kvforge.benchmarks.generate_parity --device cuda [--json FILE]

For each model, dtype and KV-cache dtype it prints, per backend, how many
requests produced exactly the reference's tokens and the mean fraction of each
request's tokens generated before the first difference. A float32 run is
expected to match exactly; in 16-bit floats two correct kernels may round a
near-tie differently, after which the sequences diverge (expected, reported).
Exit status 1 when a backend fails to run, or differs in float32 over a float KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from kvforge.core import ATTENTION_BACKEND, build_registry

REFERENCE = "reference"
# (model, dtype, KV-cache dtype, weight quantizer)
RUNS = [
    ("kvforge-tiny", "float32", "auto", None),
    ("kvforge-tiny", "bfloat16", "auto", None),
    ("kvforge-tiny", "bfloat16", "int8", None),
    ("kvforge-tiny", "bfloat16", "fp8_e4m3", None),
    ("kvforge-tiny", "float32", "auto", "int8_weight"),
    ("bench-llama-50m", "float32", "auto", None),
    ("bench-llama-50m", "bfloat16", "auto", None),
]


def prompts(vocab_size: int, count: int = 12, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (a few longer than the step's token budget,
    so they prefill in chunks) and a shared 48-token prefix on half (prefix caching)."""
    gen = torch.Generator().manual_seed(seed)
    low = min(16, vocab_size - 1)  # clear of the special ids at the bottom of synthetic vocabularies
    shared = torch.randint(low, vocab_size - 3, (48,), generator=gen).tolist()
    out = []
    for i in range(count):
        length = [5, 37, 150, 300][i % 4]
        own = torch.randint(low, vocab_size - 3, (length,), generator=gen).tolist()
        out.append(shared + own if i % 2 else own)
    return out


def generate(model: str, device: str, dtype: str, kv_cache_dtype: str, weights: str | None, backend: str,
             max_tokens: int) -> list[list[int]]:
    from kvforge.benchmarks.model_dirs import model_dir
    from kvforge import LLM, SamplingParams

    llm = LLM(str(model_dir(model)), device=device, dtype=dtype, attention={"backend": backend},
              cache={"kv_cache_dtype": kv_cache_dtype, "num_blocks": 512},
              scheduler={"max_num_batched_tokens": 256}, quantization={"weights": weights})
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts(vocab), sampling_params=params)
    for output in outputs:
        if output.finish_reason == "error":
            raise RuntimeError(f"request {output.request_id} failed: {output.error}")
    return [list(output.outputs[0].token_ids) for output in outputs]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(requests identical to the reference, mean fraction of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for got, want in zip(tokens, reference):
        same += got == want
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefix += first / max(len(want), 1)
    return same, prefix / max(len(reference), 1)


def backends_for(device: str) -> list[str]:
    names = []
    for registration in build_registry().implementations(ATTENTION_BACKEND):
        cls = registration.cls
        if registration.name != REFERENCE and device in cls.devices and cls.availability().ok:
            names.append(registration.name)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--models", nargs="*", help="only these models (default: all of RUNS)")
    parser.add_argument("--json", help="write the rows to this file as well")
    args = parser.parse_args(argv)
    rows, failed = [], False
    names = backends_for(args.device)
    print(f"backends on {args.device}: {', '.join(names)} (against {REFERENCE})")
    print(f"{'model':<16} {'dtype':<9} {'kv':<9} {'weights':<12} {'backend':<10} {'identical':>10} {'prefix':>7}")
    for model, dtype, kv, weights in RUNS:
        if args.models and model not in args.models:
            continue
        try:
            reference = generate(model, args.device, dtype, kv, weights, REFERENCE, args.max_tokens)
        except Exception:  # noqa: BLE001 - reported, the other runs go on
            print(f"{model:<16} {dtype:<9} {kv:<9} {weights or '-':<12} {REFERENCE:<10} FAILED")
            traceback.print_exc()
            failed = True
            continue
        for name in names:
            row = dict(model=model, dtype=dtype, kv_cache_dtype=kv, weights=weights, backend=name)
            try:
                tokens = generate(model, args.device, dtype, kv, weights, name, args.max_tokens)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"{model:<16} {dtype:<9} {kv:<9} {weights or '-':<12} {name:<10} FAILED: {row['error']}")
                traceback.print_exc()
                failed = True
                rows.append(row)
                continue
            same, prefix = agreement(tokens, reference)
            row.update(identical=same, requests=len(reference), prefix=round(prefix, 4))
            rows.append(row)
            exact_expected = dtype == "float32" and kv == "auto"
            failed |= exact_expected and same != len(reference)
            print(f"{model:<16} {dtype:<9} {kv:<9} {weights or '-':<12} {name:<10} "
                  f"{same:>4}/{len(reference):<5} {prefix:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
