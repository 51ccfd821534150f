"""`kvforge serve` driven by the official `openai` client: completions and chat,
streamed and not, sync and async; streamed deltas add up to the non-streamed
text; greedy outputs are those of offline `LLM.generate`; OpenAI's shapes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import openai_client, running_server  # noqa: E402

from kvforge import LLM, SamplingParams  # noqa: E402

MODEL = "kvforge-tiny"
PROMPTS = [f"def f{i}(x):\n    return" for i in range(64)]


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def offline():
    return LLM(model=MODEL)


def test_models_lists_the_served_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024


def test_greedy_completions_are_the_offline_outputs(client, offline):
    expected = offline.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12))
    response = client.completions.create(model=MODEL, prompt=PROMPTS[:4], max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")


def test_completion_stream_deltas_add_up_to_the_text_with_usage_last(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not_give_the_same_reply(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    reply = whole.choices[0].message
    assert reply.role == "assistant" and whole.object == "chat.completion"
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_uses_the_documented_default_template(client, offline):
    from kvforge.serving.chat_template import default_chat_prompt

    messages = [{"role": "user", "content": "import os"}]
    prompt = default_chat_prompt(messages)
    assert prompt == "user: import os\nassistant:"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_n_samples_seeded_are_reproducible_and_logprobs_are_consistent(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[7], max_tokens=8, temperature=1.0, n=3, seed=11, logprobs=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "three seeded samples of 8 tokens were all identical"
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert "".join(lp.tokens) == choice.text  # byte tokenizer, ASCII output
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert first.usage.completion_tokens == 24


def test_greedy_chat_logprobs_pick_the_most_likely_token(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "for i in"}],
                                           max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert entry.bytes == list(entry.token.encode())


def test_stop_string_ends_the_text_before_it(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0).choices[0].text
    stop = whole[8:11]
    assert stop and stop not in whole[:8]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_ignore_eos_and_priority_and_cache_salt_are_accepted(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True, "priority": 0, "cache_salt": "tenant",
                                                     "top_k": 5})
    assert response.usage.completion_tokens == 5


def test_64_concurrent_async_streams_add_up_to_the_offline_greedy_texts(server, offline):
    expected = [o.text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))]

    async def one(aclient, prompt: str) -> tuple[str, str | None]:
        text, reason = [], None
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                  stream=True)
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def main():
        aclient = openai_client(server, async_=True)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert [text for text, _ in results] == expected
    assert all(reason == "length" for _, reason in results)


def test_async_chat_not_streamed(server):
    async def main():
        aclient = openai_client(server, async_=True)
        try:
            return await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=4, temperature=0)
        finally:
            await aclient.close()

    reply = asyncio.run(main())
    assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content


def test_metrics_have_vllm_names_and_count_what_was_served(server, client):
    before = server.metric("vllm:request_success_total", finished_reason="length")
    ttft_before = server.metric("vllm:time_to_first_token_seconds_count")
    tokens_before = server.metric("vllm:generation_tokens_total")
    client.completions.create(model=MODEL, prompt=PROMPTS[11], max_tokens=7, temperature=0)
    assert server.metric("vllm:request_success_total", finished_reason="length") == before + 1
    assert server.metric("vllm:time_to_first_token_seconds_count") == ttft_before + 1
    assert server.metric("vllm:generation_tokens_total") == tokens_before + 7
    _, text = server.get("/metrics")
    text = text.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in text, name
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="kvforge-tiny"}' in text
    assert 'le="2560.0"' in text  # vLLM's last TTFT bucket


def test_same_prompt_twice_hits_the_prefix_cache_unless_salts_differ(server, client):
    prompt = "x = [" + ", ".join(str(i) for i in range(40)) + "]\n"  # several full blocks

    def hits_of(**extra) -> float:
        before = server.metric("vllm:prefix_cache_hits_total")
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return server.metric("vllm:prefix_cache_hits_total") - before

    hits_of(cache_salt="a")
    assert hits_of(cache_salt="a") > 0
    assert hits_of(cache_salt="b") == 0


def test_streamed_choices_of_several_prompts_and_samples_add_up_to_the_non_streamed_ones(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[20:22], max_tokens=6, temperature=0.9, n=2, seed=5)
    whole = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    assert sorted(whole) == [0, 1, 2, 3]  # prompt i, sample j at i * n + j
    streamed: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
    assert streamed == whole
    assert finishes == {i: 1 for i in range(4)}  # each choice finishes exactly once


def test_streamed_chat_samples_open_with_the_role_and_add_up(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "while"}], max_tokens=5, temperature=0.9, n=2,
                  seed=9)
    whole = {c.index: c.message.content for c in client.chat.completions.create(**kwargs).choices}
    streamed: dict[int, str] = {}
    roles = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(roles) == [0, 1] and streamed == whole
