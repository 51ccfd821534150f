"""Speculation on the built-in kvforge-tiny (a real byte-level Llama and its
tokenizer): text, logprobs and n > 1 samples match decoding without it, and
seeded sampling is reproducible."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = ["the cat sat on the mat. the cat sat on the", "def f(x):\n    return x\ndef g(x):\n    return"]


@pytest.fixture(scope="module")
def engines():
    common = {"device": "cpu", "dtype": "float32", "cache": {"block_size": 8, "num_blocks": 128}}
    return LLM("kvforge-tiny", **common), LLM("kvforge-tiny", speculative={"proposer": "ngram"}, **common)


def test_greedy_text_logprobs_and_samples_match_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=3, n=2, ignore_eos=True)
    expected, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert spec.engine.metrics()["spec_accepted_tokens"] > 0
    for a, b in zip(expected, got):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids and y.text == x.text and len(y.logprobs) == 48
            for token, lx, ly in zip(y.token_ids, x.logprobs, y.logprobs):
                assert set(lx) == set(ly) and ly[token] == pytest.approx(lx[token], abs=1e-4)


def test_stop_string_with_a_real_tokenizer(engines):
    plain, spec = engines
    text = plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=48))[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=48, stop=[stop])
    a, b = plain.generate(PROMPTS[:1], params)[0], spec.generate(PROMPTS[:1], params)[0]
    assert b.text == a.text == text[:text.index(stop)] and b.token_ids == a.token_ids and b.finish_reason == "stop"


def test_seeded_sampling_with_speculation_is_reproducible(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=7)
    first = [o.token_ids for o in spec.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == first
