"""The engine's start-up warm-up step: it runs the model once (on a GPU over a
full step's worth of tokens, on a CPU over one short sequence), and leaves
nothing behind (no blocks held, no prefix-cache entries a later request could
hit, no counters moved, the same outputs)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvforge.core import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams
import torch

from kvforge.engine.warmup import CPU_TOKENS, PROMPT_LEN, warm_up, warm_up_tokens

sys.path.insert(0, str(Path(__file__).parent))
from engine_fakes import FakeCausalLM, reference_greedy


def engine(warmup: bool, model=None, num_blocks: int = 200, budget: int = 512) -> LLMEngine:
    config = EngineConfig(device="cpu", dtype="float32", warmup=warmup,
                          cache={"num_blocks": num_blocks, "block_size": 4, "enable_prefix_caching": True},
                          scheduler={"max_num_seqs": 8, "max_num_batched_tokens": budget})
    return LLMEngine(config, model=model or FakeCausalLM())


class RecordingRunner:
    """Records the entries of each step it is asked to run."""

    def __init__(self):
        self.steps = []

    def execute(self, entries):
        self.steps.append([(e.request.request_id, e.num_tokens) for e in entries])


def test_warmup_is_a_full_step_on_a_gpu_and_one_short_sequence_on_a_cpu():
    assert warm_up_tokens(torch.device("cuda"), 2048) == 2048
    assert warm_up_tokens(torch.device("cpu"), 2048) == CPU_TOKENS < PROMPT_LEN
    assert warm_up_tokens(torch.device("cpu"), 4) == 4  # never above the step budget
    gpu_sized = engine(False).kv
    runner = RecordingRunner()
    assert warm_up(runner, gpu_sized, max_num_batched_tokens=warm_up_tokens(torch.device("cuda"), 512),
                   max_num_seqs=8, max_model_len=256) == 4 * PROMPT_LEN  # 512 tokens in sequences of 128
    assert [tokens for _, tokens in runner.steps[0]] == [PROMPT_LEN] * 4
    model = FakeCausalLM()
    planned = []
    plan = model.plan
    model.plan = lambda batch: planned.append(batch.seq_lens.tolist()) or plan(batch)
    engine(True, model, budget=512)  # a CPU engine: one sequence of CPU_TOKENS, whatever the budget
    assert planned == [[CPU_TOKENS]]


def test_warmup_runs_one_step_and_leaves_nothing_behind():
    model = FakeCausalLM()
    warm = engine(True, model)
    assert model.plans == 1  # one step, before any request
    usage = warm.kv.usage()
    assert usage.free == warm.num_blocks and not warm.kv.requests
    assert warm.metrics()["steps"] == 0 and warm.metrics()["prompt_tokens"] == 0
    # The warm-up's prompt (all zeros) was never offered to the prefix cache.
    warm.add_request("zeros", prompt_token_ids=[0] * PROMPT_LEN, params=SamplingParams(max_tokens=2, temperature=0))
    while warm.has_unfinished_requests():
        warm.step()
    assert warm.metrics()["prefix_cache_hit_rate"] == 0


def test_warmup_changes_no_output():
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8], "c": list(range(3, 40))}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    model = FakeCausalLM()
    for warmup in (False, True):
        e = engine(warmup, model)
        for request_id, prompt in prompts.items():
            e.add_request(request_id, prompt_token_ids=prompt, params=params)
        final = {}
        while e.has_unfinished_requests():
            final.update({o.request_id: o.token_ids for o in e.step(final_only=True)})
        assert final == {r: reference_greedy(model, p, 6) for r, p in prompts.items()}


def test_warmup_fits_a_small_cache_and_a_small_budget():
    model = FakeCausalLM()
    small = engine(True, model, num_blocks=8, budget=16)  # 32 tokens of cache, 16 a step
    assert model.plans == 1 and small.kv.usage().free == 8
    unwarmed = FakeCausalLM()
    tiny = engine(True, unwarmed, num_blocks=2, budget=512)  # too small for one warm-up sequence (CPU_TOKENS)
    assert unwarmed.plans == 0 and tiny.kv.usage().free == 2
