"""Reference-engine benchmarks: scheduler step overhead and end to end.

* step overhead: at batch 1, 32 and 128 running (decoding) requests, the time of
  one `LLMEngine.step` and the fraction of it spent outside the model (plan,
  forward, logits); target <= 10% at batch 32 (reported, never asserted).
* end to end: the quick `mixed` workload through `LLMEngine`, output tokens/s.

    pytest benchmarks/bench_engine.py --benchmark-only
    BENCH_MODEL=bench-llama-tiny pytest benchmarks/bench_engine.py   # a smaller model
"""

from __future__ import annotations

import os

import pytest

from kvforge.benchmarks import machine
from kvforge.benchmarks.model_dirs import model_dir

MODEL = os.environ.get("BENCH_MODEL", "bench-llama-50m")


@pytest.fixture(scope="module")
def path() -> str:
    return str(model_dir(MODEL))


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_step_overhead(benchmark, path, batch):
    """One decode step at `batch` running requests; extra_info holds the share
    of the step spent outside the model."""
    from kvforge import SamplingParams

    engine = machine.make_engine(path, batch, 8)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(8)], params=params)
    while engine.stats.num_prompt_tokens < batch * 8:  # prefill outside the timing
        engine.step()
    engine.step()  # one decode step to settle, untimed
    clock = machine.ModelClock(engine.model)
    benchmark.pedantic(engine.step, rounds=8, iterations=1)
    step, model = benchmark.stats.stats.mean, clock.seconds / 8
    benchmark.extra_info.update(step_ms=step * 1e3, model_ms=model * 1e3, overhead_fraction=max(0.0, 1 - model / step))
    assert len(engine.scheduler.running) == batch


def test_end_to_end_mixed(benchmark, path):
    import json

    from kvforge import SamplingParams
    from kvforge.benchmarks import scenarios

    vocab = json.loads(open(os.path.join(path, "config.json")).read())["vocab_size"]
    requests = scenarios.mixed(vocab, quick=True).requests[:16]
    engine = machine.make_engine(path, 16, 128)

    def run():
        for r in requests:
            engine.add_request(r["id"], prompt_token_ids=r["prompt_token_ids"],
                               params=SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
        before = engine.stats.num_generated_tokens
        while engine.has_unfinished_requests():
            engine.step()
        return engine.stats.num_generated_tokens - before

    tokens = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(output_tokens=tokens, tokens_per_s=tokens / benchmark.stats.stats.mean)
    assert tokens == sum(r["max_tokens"] for r in requests)
