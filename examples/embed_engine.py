"""Embedding the reference engine in your own serving loop.

    python examples/embed_engine.py [MODEL]     # default: kvforge-tiny

Requests arrive while others run, stream their new text as it comes, one is
aborted halfway, and the engine's metrics are printed at the end. Only the
public API is used.
"""

from __future__ import annotations

import sys

from kvforge import LLMEngine, SamplingParams, load_config


def main(model: str = "kvforge-tiny") -> dict:
    engine = LLMEngine(load_config(model=model, device="cpu", cache={"num_blocks": 256}).config)
    engine.add_request("story", "Once upon a time", SamplingParams(max_tokens=48, temperature=0.8, seed=1))
    engine.add_request("code", "def fibonacci(n):", SamplingParams(max_tokens=48, temperature=0))
    texts: dict[str, str] = {}
    tokens: dict[str, int] = {}  # tokens so far: a step may bring several (multi-step decoding)
    urgent_sent = story_aborted = False
    while engine.has_unfinished_requests():
        # a late, urgent arrival: continuous batching takes it in at once
        if not urgent_sent and tokens.get("code", 0) >= 4:
            engine.add_request("urgent", "import os", SamplingParams(max_tokens=16, temperature=0), priority=-1)
            urgent_sent = True
        if not story_aborted and tokens.get("story", 0) >= 24:
            aborted = engine.abort_request("story")  # frees its KV blocks at once
            print(f"[story] {aborted.finish_reason} after {len(aborted.token_ids)} tokens")
            story_aborted = True
        for output in engine.step():
            texts[output.request_id] = texts.get(output.request_id, "") + output.outputs[0].new_text
            tokens[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                print(f"[{output.request_id}] {output.finish_reason}: {texts[output.request_id]!r}")
    metrics = engine.metrics()
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items()})
    return metrics


if __name__ == "__main__":
    main(*sys.argv[1:])
