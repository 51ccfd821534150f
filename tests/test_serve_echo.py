"""`echo` in /v1/completions through the official `openai` client against a real
`kvforge serve kvforge-tiny`: the prompt before the text, the legacy logprobs over
prompt and generated tokens (null for the first), `max_tokens: 0` scoring the prompt
alone, a streamed echo adding up to the same answer, and `max_tokens: 0` without
echo refused with a 400 naming it."""

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


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_a_streamed_echo_adds_up_to_the_whole_answer(client, max_tokens):
    """The first chunk of a choice carries the prompt (and its logprobs), the later
    ones the generated tokens; together they are the non-streamed answer."""
    request = dict(model="kvforge-tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**request).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**request, stream=True) if chunk.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith(PROMPT) and chunks[-1].finish_reason == whole.finish_reason
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_max_tokens_zero_without_echo_is_refused_naming_it(server):
    status, _, body = server.post_json("/v1/completions", {"model": "kvforge-tiny", "prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and "max_tokens 0" in body["error"]["message"]
