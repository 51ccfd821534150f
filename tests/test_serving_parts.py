"""The server's parts without a server: chat templates, request models, vLLM's
buckets, and the metrics following an engine step by step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from pydantic import ValidationError  # noqa: E402

from kvforge.engine.sampling_params import SamplingParams  # noqa: E402
from kvforge.serving.chat_template import chat_prompt_token_ids, default_chat_prompt  # noqa: E402
from kvforge.serving.errors import APIError  # noqa: E402
from kvforge.serving.metrics import ServerMetrics, buckets_1_2_5  # noqa: E402
from kvforge.serving.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine  # noqa: E402


class TemplatedTokenizer:
    """A tokenizer with a chat template, as transformers' are."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False, "the template already wrote the special tokens"
        return [ord(c) for c in text]


class PlainTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


def test_a_tokenizer_with_a_template_renders_it_and_others_get_the_default():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    templated = chat_prompt_token_ids(TemplatedTokenizer(), messages)
    assert "".join(map(chr, templated)) == "<system>be brief<user>hi<assistant>"
    plain = chat_prompt_token_ids(PlainTokenizer(), messages)
    assert "".join(map(chr, plain)) == default_chat_prompt(messages) == "system: be brief\nuser: hi\nassistant:"


def test_chat_without_a_tokenizer_is_refused_naming_messages():
    with pytest.raises(APIError) as info:
        chat_prompt_token_ids(None, [{"role": "user", "content": "x"}])
    assert info.value.status == 400 and info.value.param == "messages"


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_every_prompt_form_becomes_a_list_of_prompts(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_request_fields_map_onto_sampling_params_and_defaults_stay_the_engines():
    body = CompletionRequest(prompt="x", n=2, temperature=0, top_k=5, stop="\n", seed=3, ignore_eos=True)
    params = body.sampling_params(max_tokens=7, logprobs=2)
    assert (params.n, params.temperature, params.top_k, params.stop, params.seed, params.ignore_eos,
            params.max_tokens, params.logprobs) == (2, 0, 5, ["\n"], 3, True, 7, 2)
    plain = CompletionRequest(prompt="x").sampling_params(max_tokens=16, logprobs=None)
    default = SamplingParams(max_tokens=16)
    assert (plain.temperature, plain.top_p, plain.top_k) == (default.temperature, default.top_p, default.top_k)


@pytest.mark.parametrize("fields, bad", [
    ({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"foo": 1}, "foo"), ({"top_p": 1.5}, "top_p"),
    ({"echo": "yes"}, "echo"), ({"logprobs": 21}, "logprobs"),
])
def test_invalid_completion_fields_are_named(fields, bad):
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt="x", **fields)
    assert [e["loc"][0] for e in info.value.errors()] == [bad]


def test_max_tokens_zero_needs_echo():
    with pytest.raises(ValidationError, match="max_tokens 0 generates nothing"):
        CompletionRequest(prompt="x", max_tokens=0)
    assert CompletionRequest(prompt="x", max_tokens=0, echo=True, stream=True).max_tokens == 0


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_zero_still_runs_one_token():
    params = CompletionRequest(prompt="x", echo=True, max_tokens=0, logprobs=1).sampling_params(0, 1)
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (1, 1, 1)
    assert CompletionRequest(prompt="x", logprobs=1).sampling_params(4, 1).prompt_logprobs is None


def test_chat_max_completion_tokens_wins_and_top_logprobs_needs_logprobs():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=9,
                                 logprobs=True, top_logprobs=3)
    assert body.requested_max_tokens == 9 and body.num_logprobs == 3
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=3)


def test_1_2_5_buckets_stop_at_the_context():
    assert buckets_1_2_5(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert buckets_1_2_5(1) == [1]


def test_metrics_follow_the_engine_step_by_step():
    engine = fake_engine(FakeCausalLM(), block_size=4, num_scheduler_steps=1)
    metrics = ServerMetrics("fake", engine.max_model_len, engine.kv.block_size)

    def sample(name: str, **labels) -> float:
        value = metrics.registry.get_sample_value(name, {"model_name": "fake", "engine": "0", **labels})
        return 0.0 if value is None else value

    for i in range(2):
        engine.add_request(f"r{i}", prompt_token_ids=list(range(1, 10)), params=SamplingParams(temperature=0,
                                                                                               max_tokens=4))
    seen_running = 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        metrics.on_step(engine, outputs, now=0.0)
        seen_running = max(seen_running, sample("vllm:num_requests_running"))
    assert seen_running == 2 and sample("vllm:num_requests_running") == 0
    assert sample("vllm:generation_tokens_total") == engine.stats.num_generated_tokens == 8
    assert sample("vllm:prompt_tokens_total") == engine.stats.num_prompt_tokens
    assert sample("vllm:request_success_total", finished_reason="length") == 2
    assert sample("vllm:time_to_first_token_seconds_count") == 2
    assert sample("vllm:inter_token_latency_seconds_count") == 2 * 3  # one per token after the first
    assert sample("vllm:e2e_request_latency_seconds_count") == 2
    assert sample("vllm:prefix_cache_hits_total") == engine.kv.usage().hits * 4
    assert sample("vllm:kv_cache_usage_perc") == 0
    metrics.on_step(engine, [], now=0.0)  # no double counting when nothing changed
    assert sample("vllm:generation_tokens_total") == 8


def test_metrics_count_every_token_of_a_burst_and_one_gap_per_output():
    # With multi-step decoding a step brings several tokens: the token counters take them
    # all, and the inter-token histogram one gap per output (vLLM's, per iteration).
    engine = fake_engine(FakeCausalLM(), block_size=4)
    metrics = ServerMetrics("fake", engine.max_model_len, engine.kv.block_size)
    engine.add_request("r", prompt_token_ids=list(range(1, 10)), params=SamplingParams(temperature=0, max_tokens=12))
    outputs_after_first = -1
    while engine.has_unfinished_requests():
        outputs = engine.step()
        outputs_after_first += len(outputs)
        metrics.on_step(engine, outputs, now=0.0)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "fake", "engine": "0"}
    assert value("vllm:generation_tokens_total", labels) == engine.stats.num_generated_tokens == 12
    assert value("vllm:inter_token_latency_seconds_count", labels) == outputs_after_first < 11
