"""Greedy generation with vLLM's CPU build, run as a script by tests/test_vllm_plugin.py
with the vLLM environment's Python: one process per setting of
KVFORGE_VLLM_ATTENTION_BACKEND, since vLLM loads its plugins once per process.

    python tests/vllm_greedy_run.py SPEC.json OUT.json

SPEC: {"runs": [{"model": DIR, "dtype": "float32", "prompts": [[ids]], "max_tokens": N}]}.
OUT, per run: the token ids of every prompt's completion, the attention implementation
classes the model's layers hold, or the error that stopped vLLM's start-up."""

from __future__ import annotations

import gc
import json
import os
import sys


def attention_impls(model) -> list[str]:
    return sorted({f"{type(m.impl).__module__}.{type(m.impl).__qualname__}" for m in model.modules()
                   if hasattr(m, "impl") and hasattr(m, "kv_cache")})


def top_two_margin(logprobs: dict) -> float:
    """How far the chosen token's log-probability is above the runner-up's at one position."""
    ranked = sorted((p.logprob for p in logprobs.values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=spec.get("max_model_len", 512), max_num_seqs=8, max_num_batched_tokens=spec.get("max_num_batched_tokens", 64),
                  block_size=spec.get("block_size", 32), enable_prefix_caching=False)
    except Exception as exc:  # the start-up refusal is what some tests look for
        return {"error": f"{type(exc).__name__}: {exc}"}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False,
                            logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "margins": [[top_two_margin(position) for position in o.outputs[0].logprobs] for o in outputs],
              "impls": llm.apply_model(attention_impls)[0]}
    del llm
    gc.collect()
    return result


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves most of the memory
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs = json.loads(open(spec_path).read())["runs"]
    results = []
    for spec in runs:
        results.append(run(spec))
        with open(out_path, "w") as out:  # what finished, even if a later run takes the process down
            json.dump({"runs": results}, out)


if __name__ == "__main__":
    main()
