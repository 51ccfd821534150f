"""SamplingParams: every invalid setting is refused with a message naming it."""

import pytest

from kvforge import SamplingParams
from kvforge.core import RequestError


@pytest.mark.parametrize("kwargs, named", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"n": 0}, "n must"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": ["x"], "detokenize": False}, "need the output text: set detokenize=True"),
])
def test_rejects_invalid_setting_naming_it(kwargs, named):
    with pytest.raises(RequestError, match=named):
        SamplingParams(**kwargs)


def test_reports_every_problem_at_once():
    with pytest.raises(RequestError) as info:
        SamplingParams(temperature=-1, top_p=2, max_tokens=0)
    assert all(name in str(info.value) for name in ("temperature", "top_p", "max_tokens"))


def test_accepts_boundaries_and_normalizes_stop():
    params = SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=0, max_tokens=1, stop="END", logprobs=0)
    assert params.greedy and params.stop == ["END"] and not params.uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
