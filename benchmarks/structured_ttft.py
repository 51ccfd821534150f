"""Compile latency as its own part of time to first token, measured in this
process: one engine per structured_output backend on the bench model, one
request at a time (so nothing queues ahead of it), first token only. Per
backend: TTFT without a spec; with a spec the engine has never seen (a cold
compile: the backend compiles it from nothing); with the same spec again (a
cached compile: the backend reuses its compiled form, the request still gets a
fresh grammar). Beside each TTFT, the compile seconds the engine itself recorded
for that request (its compile-time metric), so compile's share of TTFT is read
off, not inferred. Part of the `structured` bench scenario (structured.py)."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

from .structured_costs import backends

PROMPT_TOKENS = 32
_REQUESTS = itertools.count()


def ttft_parts(model_dir: Path, schemas: list[dict], rounds: int, dtype: str = "float32") -> dict:
    """Per backend: the TTFT (ms) of a request without a spec, with a cold spec and
    with a cached one, each the median of `rounds` (and its fastest and slowest),
    the engine's compile ms of the spec'd requests, and compile's share of their TTFT.
    The first structured request of each engine also pays the backend's set-up on
    the vocabulary; it is measured apart (`first_request_ms`) and kept out of the medians."""
    out = {}
    for cls in backends():
        usable = [s for s in schemas if not cls.spec_unsupported_reasons(_spec(s))]
        if not usable:
            continue
        engine = _engine(model_dir, cls.name, dtype)
        try:
            out[cls.name] = _measure(engine, usable, rounds)
        finally:
            engine.shutdown()
    return out


def _spec(schema: dict):
    from kvforge.core import StructuredOutputSpec

    return StructuredOutputSpec("json", json.dumps(schema))


def _engine(model_dir: Path, backend: str, dtype: str):
    from kvforge import LLMEngine
    from kvforge.core import load_config

    config = load_config(model=str(model_dir), device="cpu", dtype=dtype, cache={"memory_budget": 2**28},
                         structured_outputs={"backend": backend}).config
    return LLMEngine(config)


def _measure(engine, schemas: list[dict], rounds: int) -> dict:
    first_ms, _ = _first_token(engine, {"title": "set-up", **schemas[0]})  # the backend's set-up, once
    plain, cold, cached, plain_compile, cold_compile, cached_compile = [], [], [], [], [], []
    for i in range(rounds):
        for j, schema in enumerate(schemas):
            ttft, compile_ms = _first_token(engine, None)
            plain.append(ttft)
            plain_compile.append(compile_ms)
            fresh = {**schema, "title": f"round {i} schema {j}"}  # a spec text no cache has seen
            ttft, compile_ms = _first_token(engine, fresh)
            cold.append(ttft)
            cold_compile.append(compile_ms)
            ttft, compile_ms = _first_token(engine, fresh)
            cached.append(ttft)
            cached_compile.append(compile_ms)
    return {"requests": len(plain), "first_request_ms": first_ms,
            "ttft_ms": {"none": _spread(plain), "cold": _spread(cold), "cached": _spread(cached)},
            "compile_ms": {"none": _spread(plain_compile), "cold": _spread(cold_compile),
                           "cached": _spread(cached_compile)},
            "compile_share": {"cold": statistics.median(c / t for c, t in zip(cold_compile, cold)),
                              "cached": statistics.median(c / t for c, t in zip(cached_compile, cached))}}


def _first_token(engine, schema: dict | None) -> tuple[float, float]:
    """(ms from `add_request` to the first token, ms the engine recorded compiling for it)."""
    from kvforge import SamplingParams, StructuredOutputsParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))
    compiled = engine.metrics().get("structured_compile_seconds_sum", 0.0)
    number = next(_REQUESTS)
    start = number * PROMPT_TOKENS % (engine.vocab_size - PROMPT_TOKENS - 1)  # a new prompt: no prefill cached
    began = time.perf_counter()
    engine.add_request(f"ttft-{number}", prompt_token_ids=list(range(start + 1, start + 1 + PROMPT_TOKENS)),
                       params=params)
    while True:
        outputs = engine.step()
        if any(out.outputs[0].token_ids for out in outputs):
            break
        for out in outputs:
            if out.finished:
                raise RuntimeError(f"the TTFT request finished without a token: {out.outputs[0].error}")
        time.sleep(0)  # let the compile thread run while the request waits for its grammar
    ttft = 1e3 * (time.perf_counter() - began)
    return ttft, 1e3 * (engine.metrics().get("structured_compile_seconds_sum", 0.0) - compiled)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
