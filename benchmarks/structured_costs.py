"""What structured outputs cost a backend, measured in this process on a model's
vocabulary: compile time per spec (cold and cached), and the parts of a step's
mask (fill one row per grammar, apply the batch, accept the sampled tokens).
Part of the `structured` bench scenario (structured.py)."""

from __future__ import annotations

import random
import statistics
import time

from kvforge.core import StructuredOutputError


def backends() -> list:
    """Every available structured_output backend class, highest priority first."""
    from kvforge.core import STRUCTURED_OUTPUT, build_registry

    found = [r.cls for r in build_registry().implementations(STRUCTURED_OUTPUT) if r.availability().ok]
    return sorted(found, key=lambda cls: -cls.priority)


def compile_times(vocabulary, chosen: list, rounds: int) -> dict:
    """Per backend: its set-up on the vocabulary, and per schema the cold compile
    (a fresh backend, so no cache of its own) and the cached one (the same spec
    again), each the median of `rounds`, with the fastest and slowest."""
    out = {}
    for cls in backends():
        began = time.perf_counter()
        cls(vocabulary)
        entry = {"setup_ms": 1e3 * (time.perf_counter() - began), "specs": {}}
        for case in chosen:
            reasons = cls.spec_unsupported_reasons(case.spec)
            if reasons:
                entry["specs"][case.name] = {"refused": "; ".join(reasons)}
                continue
            try:
                entry["specs"][case.name] = _compile_rounds(cls, vocabulary, case.spec, rounds)
            except StructuredOutputError as exc:  # a backend that declares the spec but cannot compile it
                entry["specs"][case.name] = {"refused": f"failed to compile: {exc}"}
        out[cls.name] = entry
    return out


def _compile_rounds(cls, vocabulary, spec, rounds: int) -> dict:
    cold, cached = [], []
    for _ in range(rounds):
        backend = cls(vocabulary)
        began = time.perf_counter()
        backend.compile(spec)
        cold.append(1e3 * (time.perf_counter() - began))
        began = time.perf_counter()
        backend.compile(spec)
        cached.append(1e3 * (time.perf_counter() - began))
    return {"cold_ms": _spread(cold), "cached_ms": _spread(cached)}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def mask_profile(vocabulary, specs: list, batch: int, steps: int, seed: int = 0) -> dict:
    """Where a step's mask time goes, per backend: `batch` grammars (`specs` in
    turn), each step filling one row per grammar, then
    applying the whole bitmask to float32 logits in one op, then each grammar
    accepting a random allowed token. Milliseconds per step, medians; beside the
    backend's own apply, kvforge's reference op on the same bitmask."""
    import torch

    from kvforge.core import apply_token_bitmask

    rng = random.Random(seed)
    out = {}
    for cls in backends():
        backend = cls(vocabulary)
        usable = [s for s in specs if not cls.spec_unsupported_reasons(s)]
        if not usable:
            continue
        grammars = [backend.compile(usable[i % len(usable)]) for i in range(batch)]
        logits = torch.randn(batch, vocabulary.vocab_size)
        fill, apply, reference, accept = [], [], [], []
        for _ in range(steps):
            bitmask = backend.allocate_bitmask(batch)
            began = time.perf_counter()
            for row, grammar in enumerate(grammars):
                grammar.fill_bitmask(bitmask, row)
            fill.append(time.perf_counter() - began)
            began = time.perf_counter()
            backend.apply_bitmask(logits, bitmask)
            apply.append(time.perf_counter() - began)
            copy = logits.clone()
            began = time.perf_counter()
            apply_token_bitmask(copy, bitmask)
            reference.append(time.perf_counter() - began)
            chosen_tokens = [_allowed_token(bitmask[row], rng) for row in range(batch)]
            began = time.perf_counter()
            for grammar, token in zip(grammars, chosen_tokens):
                if not grammar.accept_tokens([token]):
                    raise RuntimeError(f"{cls.name}: the grammar refused token {token} its own mask allowed")
            accept.append(time.perf_counter() - began)
        out[cls.name] = {"batch": batch, "steps": steps, "fill_ms": 1e3 * statistics.median(fill),
                         "fill_us_per_row": 1e6 * statistics.median(fill) / batch,
                         "apply_ms": 1e3 * statistics.median(apply),
                         "apply_reference_ms": 1e3 * statistics.median(reference),
                         "accept_ms": 1e3 * statistics.median(accept), "specs": len(usable)}
    return out


def _allowed_token(row, rng: random.Random) -> int:
    """A random token the bitmask row allows."""
    import torch

    words = row.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1
    allowed = torch.nonzero(bits.flatten()).flatten().tolist()
    return allowed[rng.randrange(len(allowed))]
