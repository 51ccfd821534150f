"""1,000 requests with random lengths, priorities, sampling settings and aborts:
every request ends exactly once and every block returns to the pool.

Runs a real (tiny, random) Llama loaded through kvforge.models, with the
attention backend `auto` picks: one layer, 16 wide, so it stays fast."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLMEngine, SamplingParams
from kvforge.core import EngineConfig

transformers = pytest.importorskip("transformers")
EOS = 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=EOS, pad_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("stress-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)



@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_thousand_random_requests_each_end_once_and_free_every_block(policy, tiny_llama):
    rng = random.Random(policy)
    engine = LLMEngine(EngineConfig(
        model=tiny_llama, device="cpu", dtype="float32", cache={"num_blocks": 40, "block_size": 4},
        scheduler={"policy": policy, "max_num_seqs": 16, "max_num_batched_tokens": 48}))
    ended: dict[str, int] = {}
    added, live = 0, []
    total = 1000

    def record(output):
        if output.finished:
            ended[output.request_id] = ended.get(output.request_id, 0) + 1

    while added < total or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 12)):
            if added == total:
                break
            request_id = f"r{added}"
            params = SamplingParams(
                max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.8]), n=rng.choice([1, 1, 1, 2, 3]),
                seed=rng.choice([None, added]), ignore_eos=rng.random() < 0.3)
            prompt = [rng.randrange(40) for _ in range(rng.randint(1, 40))]
            engine.add_request(request_id, prompt, params, priority=rng.randint(0, 3))
            live.append(request_id)
            added += 1
        for request_id in rng.sample(live, k=min(len(live), rng.choice([0, 0, 0, 1]))):
            output = engine.abort_request(request_id)
            if output is not None:
                assert output.finished and all(c.finish_reason for c in output.outputs)
                record(output)
        for output in engine.step():
            record(output)
        live = [r for r in live if r in engine.groups]

    assert sorted(ended) == sorted(f"r{i}" for i in range(total))
    assert set(ended.values()) == {1}
    usage = engine.kv.usage()
    assert usage.in_use == 0 and usage.free == usage.num_blocks
    assert engine.kv.requests == {} and not engine.scheduler.running and not engine.scheduler.waiting
    metrics = engine.metrics()
    assert metrics["preemptions"] > 0 and metrics["aborted"] > 0
    assert metrics["finished"] + metrics["aborted"] == total
