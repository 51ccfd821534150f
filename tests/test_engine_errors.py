"""Bad input gets a clear error for that request alone; the others finish and
nothing leaks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.core import RequestError

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def engine(**kwargs):
    return fake_engine(FakeCausalLM(vocab_size=48, max_model_len=32), num_blocks=6, block_size=4, **kwargs)


def run_all(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    (list(range(33)), GREEDY, "more than the model's context of 32"),
    ([1, 2, 48], GREEDY, r"outside the vocabulary \[0, 48\)"),
    ([-1], GREEDY, "outside the vocabulary"),
    (list(range(25)), GREEDY, "needs 7 KV blocks but the whole cache has 6"),
    ("text", GREEDY, "needs a tokenizer"),
    ([1, 2], {"temperature": 0}, "must be a SamplingParams"),
])
def test_bad_request_is_refused_alone_and_the_others_finish(prompt, params, message):
    e = engine()
    e.add_request("good1", [1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match=message):
        e.add_request("bad", prompt, params)
    e.add_request("good2", [4, 5], GREEDY)
    done = run_all(e)
    assert sorted(done) == ["good1", "good2"]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in done.values())
    assert e.kv.usage().in_use == 0 and e.kv.requests == {}


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.01}, {"max_tokens": 0}])
def test_invalid_sampling_parameters_raise_before_anything_is_queued(kwargs):
    with pytest.raises(RequestError, match="invalid sampling parameters"):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused_while_the_first_runs():
    e = engine()
    e.add_request("a", [1, 2], GREEDY)
    with pytest.raises(RequestError, match="still running"):
        e.add_request("a", [3], GREEDY)
    assert sorted(run_all(e)) == ["a"]
    e.add_request("a", [3], GREEDY)  # reusable once finished
    assert sorted(run_all(e)) == ["a"]


def test_request_outgrowing_the_whole_cache_stops_alone_with_length():
    e = engine()
    e.add_request("grows", list(range(20)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    e.add_request("small", [1], GREEDY)
    done = run_all(e)
    assert done["grows"].finish_reason == "length" and 0 < len(done["grows"].token_ids) < 10
    assert done["small"].finish_reason == "length" and len(done["small"].token_ids) == 4
    assert e.kv.usage().in_use == 0


def test_generate_turns_a_bad_prompt_into_an_error_output_and_runs_the_rest():
    llm = LLM.from_engine(engine())
    outputs = llm.generate(prompt_token_ids=[[1, 2], [], [3, 99], [4]], sampling_params=GREEDY)
    assert [o.finish_reason for o in outputs] == ["length", "error", "error", "length"]
    assert "empty" in outputs[1].error and "vocabulary" in outputs[2].error
    assert outputs[0].error is None and len(outputs[3].token_ids) == 4
    assert llm.engine.kv.usage().in_use == 0
