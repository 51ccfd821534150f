"""Requests that arrive together with a shared prompt prefix: the first computes
it, the others wait one step and take it from the prefix cache instead of
computing the same blocks again in the same step. Outputs do not change."""

from __future__ import annotations

import sys
from pathlib import Path

from kvforge.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy

SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]  # four blocks of 4


def run(engine, prompts):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o.token_ids for o in engine.step(final_only=True)})
    return final


def test_a_shared_prefix_is_computed_once_when_requests_arrive_together():
    model = FakeCausalLM()
    prompts = {f"r{i}": SHARED + [10 + i, 20 + i] for i in range(4)}
    on = fake_engine(model, prefix_caching=True, max_num_batched_tokens=256, warmup=False)
    off = fake_engine(model, prefix_caching=False, max_num_batched_tokens=256, warmup=False)
    assert run(on, prompts) == run(off, prompts) == {r: reference_greedy(model, p, 4) for r, p in prompts.items()}
    # Off: every prompt token computed. On: the 16 shared tokens once, then each request's own 2.
    assert off.metrics()["prompt_tokens"] == 4 * 18
    assert on.metrics()["prompt_tokens"] == 18 + 3 * 2


def test_requests_without_a_shared_prefix_all_start_in_the_first_step():
    engine = fake_engine(FakeCausalLM(), prefix_caching=True, max_num_batched_tokens=256, warmup=False)
    prompts = {f"r{i}": [i + 1] + SHARED[1:] for i in range(4)}  # differ in the first block: nothing shared
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert len(engine.scheduler.running) == 4
