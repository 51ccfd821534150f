"""`echo` in /v1/completions through the official `openai` client against a real
`kvforge serve kvforge-tiny`: the prompt before the text, the legacy logprobs over
prompt and generated tokens (null for the first), `max_tokens: 0` scoring the prompt
alone, and echo with stream refused with a 400 naming it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import openai_client, running_server  # noqa: E402

from kvforge import LLM  # noqa: E402
from kvforge.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = "The cat sat on the mat."
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server():
    with running_server() as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def offline():
    """The same model's prompt logprobs, offline: what the server must echo."""
    llm = LLM("kvforge-tiny", dtype="float32")
    (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    return output


def test_echo_puts_the_prompt_and_its_logprobs_before_the_generated_ones(client, offline):
    reply = client.completions.create(model="kvforge-tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                      logprobs=2)
    (choice,) = reply.choices
    plain = client.completions.create(model="kvforge-tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    prompt_len = len(offline.prompt_token_ids)
    assert len(logprobs.tokens) == prompt_len + 3
    assert "".join(logprobs.tokens) == choice.text  # byte tokens: their texts add up to the text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, prompt_len):
        token = offline.prompt_token_ids[i]
        assert math.isclose(logprobs.token_logprobs[i], offline.prompt_logprobs[i][token].logprob, abs_tol=TOLERANCE)
        assert 2 <= len(logprobs.top_logprobs[i]) <= 3  # its own token and the top 2
    assert logprobs.token_logprobs[prompt_len:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=TOLERANCE)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert reply.usage.completion_tokens == 3


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, offline):
    reply = client.completions.create(model="kvforge-tiny", prompt=offline.prompt_token_ids, max_tokens=0,
                                      temperature=0, echo=True, logprobs=1)
    (choice,) = reply.choices
    assert choice.text == PROMPT  # token ids are echoed as their text
    assert len(choice.logprobs.token_logprobs) == len(offline.prompt_token_ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [r[t].logprob for t, r in zip(offline.prompt_token_ids[1:], offline.prompt_logprobs[1:])], abs=TOLERANCE)
    assert reply.usage.completion_tokens == 0 and choice.finish_reason == "length"


def test_a_batch_of_token_id_prompts_as_lm_eval_sends_them(client, offline):
    ids = offline.prompt_token_ids
    reply = client.completions.create(model="kvforge-tiny", prompt=[ids, ids[:5]], max_tokens=1, temperature=0,
                                      echo=True, logprobs=1, seed=1234)
    first, second = sorted(reply.choices, key=lambda c: c.index)
    assert len(first.logprobs.token_logprobs) == len(ids) + 1 and len(second.logprobs.token_logprobs) == 6
    assert second.logprobs.token_logprobs[1:5] == pytest.approx(first.logprobs.token_logprobs[1:5], abs=TOLERANCE)


def test_echo_without_logprobs_echoes_the_text_only(client):
    reply = client.completions.create(model="kvforge-tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert reply.choices[0].text.startswith(PROMPT) and reply.choices[0].logprobs is None


@pytest.mark.parametrize("extra, named", [({"echo": True, "stream": True}, "stream"),
                                          ({"max_tokens": 0}, "max_tokens 0")])
def test_echo_with_stream_and_max_tokens_zero_without_echo_are_refused(server, extra, named):
    status, _, body = server.post_json("/v1/completions", {"model": "kvforge-tiny", "prompt": PROMPT, **extra})
    assert status == 400 and named in body["error"]["message"]
