"""`logit_bias` (OpenAI's): a number in [-100, 100] per token id, added to that
token's logit before temperature, penalties and masks. Checked where a wrong
implementation would show: greedy output moves exactly when a bias crosses the
gap between the top two logits, -100 bans, +100 forces, and bad keys and values
are refused naming the key, by SamplingParams, the engine and the API."""

from __future__ import annotations

import math

import pytest

from kvforge import LLM, SamplingParams
from kvforge.core import RequestError

PROMPT = [256, *b"def main():\n    "]  # bos, then Python: kvforge-tiny was trained on Python sources


@pytest.fixture(scope="module")
def llm():
    return LLM("kvforge-tiny", device="cpu", dtype="float32")


def greedy(llm, max_tokens: int = 8, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kwargs)
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0]


def test_string_keys_become_token_ids_and_bad_entries_are_named():
    assert SamplingParams(logit_bias={"5": 1.5, 7: -2}).logit_bias == {5: 1.5, 7: -2}
    assert SamplingParams(logit_bias={0: -100, 1: 100}).logit_bias == {0: -100, 1: 100}
    for bias, named in [({"x": 1}, "logit_bias key 'x' is not a token id"),
                        ({-1: 1}, "logit_bias key -1 is not a token id"),
                        ({5: 100.5}, r"logit_bias\[5\] must be a number in \[-100, 100\], got 100.5"),
                        ({5: True}, r"logit_bias\[5\] must be a number"),
                        ({5: math.nan}, r"logit_bias\[5\] must be a number"),
                        ([5], "logit_bias must be a dict")]:
        with pytest.raises(RequestError, match=named):
            SamplingParams(logit_bias=bias)


def test_a_bias_moves_greedy_output_exactly_when_it_crosses_the_gap(llm):
    first = greedy(llm, max_tokens=1, logprobs=2)
    (top, runner_up) = sorted(first.logprobs[0].items(), key=lambda item: -item[1])[:2]
    gap = top[1] - runner_up[1]  # logprobs differ by what the logits differ by
    assert greedy(llm, max_tokens=1, logit_bias={runner_up[0]: gap - 0.01}).token_ids == [top[0]]
    assert greedy(llm, max_tokens=1, logit_bias={runner_up[0]: gap + 0.01}).token_ids == [runner_up[0]]
    assert greedy(llm, max_tokens=1, logit_bias={top[0]: -gap - 0.01}).token_ids == [runner_up[0]]


def test_minus_100_bans_a_token_and_plus_100_forces_one(llm):
    plain = greedy(llm).token_ids
    banned = greedy(llm, logit_bias={plain[0]: -100}).token_ids
    assert banned[0] != plain[0] and plain[0] not in banned
    forced = ord("@")
    assert forced not in plain and greedy(llm, logit_bias={forced: 100}).token_ids == [forced] * len(plain)


def test_the_logprobs_stay_the_models_own(llm):
    plain, biased = greedy(llm, max_tokens=1, logprobs=1), greedy(llm, max_tokens=1, logprobs=1,
                                                                  logit_bias={ord("@"): 100})
    assert biased.token_ids == [ord("@")]
    assert biased.logprobs[0][ord("@")] < max(plain.logprobs[0].values())  # raw, as returned without the bias


def test_the_engine_refuses_a_token_id_outside_the_vocabulary_naming_it(llm):
    with pytest.raises(RequestError, match=r"logit_bias keys \[259\] are outside the vocabulary \[0, 259\)"):
        llm.engine.add_request("r", prompt_token_ids=PROMPT, params=SamplingParams(logit_bias={259: 1}))
