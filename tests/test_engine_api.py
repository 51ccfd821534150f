"""The engine's public behaviour: stopping, n > 1 sampling over shared blocks,
seeds, streaming, logprobs, timings, metrics and one plan per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.core import RequestError

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, FakeTokenizer, fake_engine, reference_greedy  # noqa: E402

PROMPT = [5, 9, 2, 7, 1, 3, 3, 8]


def llm(**kwargs) -> LLM:
    kwargs.setdefault("tokenizer", FakeTokenizer())
    return LLM.from_engine(fake_engine(kwargs.pop("model", None) or FakeCausalLM(), **kwargs))


def greedy(max_tokens=12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def test_public_names_are_exported():
    import kvforge

    assert kvforge.LLM is LLM and kvforge.LLMEngine is LLMEngine and kvforge.SamplingParams is SamplingParams


def test_text_prompts_are_encoded_and_outputs_decoded():
    out = llm().generate(["hello", "abc"], greedy(6))
    assert out[0].prompt == "hello" and out[0].prompt_token_ids == FakeTokenizer().encode("hello")
    assert all(o.text == FakeTokenizer().decode(o.token_ids) and len(o.token_ids) == 6 for o in out)


def test_detokenize_off_gives_the_same_tokens_and_no_text():
    on, off = llm().generate(["hello", "abc"], [greedy(6), greedy(6, detokenize=False)])
    assert on.token_ids == llm().generate(["hello"], greedy(6))[0].token_ids and on.text
    assert off.token_ids == llm().generate(["abc"], greedy(6))[0].token_ids and off.text == ""


def test_stop_token_ends_the_request_and_is_left_out_of_the_text():
    model = FakeCausalLM()
    expected = reference_greedy(model, PROMPT, 12)
    stop = expected[4]
    cut = expected.index(stop)
    out = llm(model=model).generate(prompt_token_ids=[PROMPT], sampling_params=greedy(stop_token_ids=[stop]))[0]
    assert out.token_ids == expected[:cut + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop and out.text == FakeTokenizer().decode(expected[:cut])


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    model = FakeCausalLM()
    expected = reference_greedy(model, PROMPT, 12)
    model.eos_token_id = expected[2]
    first = expected.index(expected[2])
    engine_llm = llm(model=model)
    [stopped, ignored, held] = engine_llm.generate(
        prompt_token_ids=[PROMPT] * 3,
        sampling_params=[greedy(), greedy(ignore_eos=True), greedy(min_tokens=first + 2)])
    assert stopped.finish_reason == "stop" and stopped.token_ids == expected[:first + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == expected
    assert len(held.token_ids) > first + 1  # the EOS was masked while below min_tokens


def test_stop_string_cuts_the_text_there():
    model = FakeCausalLM()
    text = FakeTokenizer().decode(reference_greedy(model, PROMPT, 12))
    stop = text[3:5]
    out = llm(model=model).generate(prompt_token_ids=[PROMPT], sampling_params=greedy(stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_n_samples_share_the_prompt_blocks_through_fork():
    e = fake_engine(FakeCausalLM(), num_blocks=32, block_size=4, num_scheduler_steps=1)
    e.add_request("a", PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6))
    e.step()  # prefill once, fork three samples, sample four first tokens
    assert e.kv.usage().in_use == 2  # the prompt's two blocks, shared by all four
    assert len(e.scheduler.running) == 4 and e.metrics()["prompt_tokens"] == len(PROMPT)
    e.step()  # each writes its next token into a block of its own
    assert e.kv.usage().in_use == 2 + 4
    while e.has_unfinished_requests():
        outputs = e.step()
    [out] = outputs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeded streams
    assert e.kv.usage().in_use == 0


def test_n_greedy_samples_over_a_partial_block_copy_on_write_and_match():
    model = FakeCausalLM()
    prompt = PROMPT[:6]  # the last prompt block is partly filled and shared
    out = llm(model=model, block_size=4).generate(prompt_token_ids=[prompt],
                                                  sampling_params=greedy(8, n=3))[0]
    assert all(c.token_ids == reference_greedy(model, prompt, 8) for c in out.outputs)


def test_seeded_request_yields_the_same_tokens_whatever_shares_its_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10)
    alone = llm().generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].token_ids
    crowd = [[i % 40 + 1] * (i + 1) for i in range(9)]
    crowded = llm(seed=7, max_num_batched_tokens=8, num_blocks=12)
    mixed = crowded.generate(
        prompt_token_ids=crowd[:4] + [PROMPT] + crowd[4:],
        sampling_params=[SamplingParams(temperature=1.0, max_tokens=10)] * 4 + [params]
        + [SamplingParams(temperature=1.0, max_tokens=10)] * 5)
    assert mixed[4].token_ids == alone
    assert crowded.engine.metrics()["preemptions"] > 0  # recomputation does not disturb the stream


def test_streaming_yields_increments_that_add_up_to_the_final_output():
    engine_llm = llm()
    pieces: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    final = {}
    for output in engine_llm.stream(["abcdefgh", "xyz"], greedy(5)):
        completion = output.outputs[0]
        pieces.setdefault(output.request_id, []).extend(completion.new_token_ids)
        text[output.request_id] = text.get(output.request_id, "") + completion.new_text
        if output.finished:
            final[output.request_id] = output
    assert set(final) == {"0", "1"}
    assert all(pieces[k] == final[k].token_ids and text[k] == final[k].text for k in final)


def test_logprobs_cover_each_token_and_include_the_chosen_one():
    out = llm().generate(prompt_token_ids=[PROMPT], sampling_params=greedy(5, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token, step in zip(out.token_ids, out.logprobs):
        assert token in step and len(step) == 3  # greedy: the chosen token is the top one
        assert max(step.values()) == step[token] <= 0
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(s[t] for t, s in zip(out.token_ids, out.logprobs)))
    assert llm().generate(prompt_token_ids=[PROMPT], sampling_params=greedy(2))[0].logprobs is None


def test_timings_measure_first_token_and_time_per_output_token():
    out = llm().generate(prompt_token_ids=[PROMPT], sampling_params=greedy(4))[0]
    timings = out.timings
    assert 0 <= timings.ttft and timings.tpot is not None and timings.tpot >= 0
    assert timings.finish_time >= timings.first_token_time >= timings.arrival_time


def test_plan_is_called_once_per_step():
    model = FakeCausalLM()
    engine = fake_engine(model, max_num_batched_tokens=8)
    model.plans = 0  # the engine's start-up warm-up step planned once
    for i in range(5):
        engine.add_request(str(i), PROMPT, greedy(3))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert model.plans == steps


def test_abort_frees_blocks_at_once_and_reports_the_request_once():
    engine = fake_engine(FakeCausalLM())
    engine.add_request("a", PROMPT * 2, greedy(50, n=2))
    engine.add_request("b", PROMPT, greedy(3))
    engine.step()
    engine.step()
    assert engine.kv.usage().in_use > 0
    aborted = engine.abort_request("a")
    assert aborted.finished and {c.finish_reason for c in aborted.outputs} == {"abort"}
    assert engine.abort_request("a") is None
    while engine.has_unfinished_requests():
        assert all(o.request_id == "b" for o in engine.step())
    assert engine.kv.usage().in_use == 0 and engine.metrics()["aborted"] == 1


def test_high_priority_request_starts_before_every_lower_priority_waiting_one():
    engine = fake_engine(FakeCausalLM(), num_blocks=8, block_size=4, max_num_seqs=2, policy="priority")
    for i in range(4):  # distinct prompts: a shared one would make them wait for its cached blocks, not preempt
        engine.add_request(f"low{i}", [1 + i] + PROMPT[1:], greedy(6), priority=5)
    engine.step()
    engine.add_request("high", PROMPT, greedy(6), priority=0)
    first_token = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            first_token.setdefault(output.request_id, step)
    assert first_token["high"] < min(first_token[f"low{i}"] for i in (2, 3))
    assert engine.metrics()["preemptions"] > 0


def test_metrics_report_queue_cache_and_preemption_figures():
    engine = fake_engine(FakeCausalLM(), num_blocks=8, block_size=4)
    for i in range(6):
        engine.add_request(str(i), PROMPT + [i], greedy(8))
    engine.step()
    figures = engine.metrics()
    assert figures["running"] + figures["waiting"] == 6
    assert 0 < figures["kv_usage"] <= 1
    while engine.has_unfinished_requests():
        engine.step()
    figures = engine.metrics()
    assert figures["preemptions"] > 0 and figures["prefix_cache_hit_rate"] > 0
    assert {"spec_acceptance_rate", "generated_tokens", "finished"} <= set(figures)
    assert figures["generated_tokens"] == 48 and figures["kv_usage"] == 0


def test_prometheus_text_needs_prometheus_client_only_when_asked():
    engine = fake_engine(FakeCausalLM())
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install prometheus_client"):
            engine.metrics_prometheus()
    else:
        assert "kvforge_kv_usage" in engine.metrics_prometheus()


def test_streamed_text_adds_up_to_the_final_text_cut_at_a_stop_string():
    model = FakeCausalLM()
    text = FakeTokenizer().decode(reference_greedy(model, PROMPT, 12))
    stop = text[5:8]
    streamed, final = "", None
    for output in llm(model=model).stream(prompt_token_ids=[PROMPT], sampling_params=greedy(stop=[stop])):
        streamed += output.outputs[0].new_text
        final = output
    assert final.finished and final.text == text[:text.index(stop)] == streamed


def test_stop_strings_before_min_tokens_are_ignored():
    model = FakeCausalLM()
    text = FakeTokenizer().decode(reference_greedy(model, PROMPT, 12))
    out = llm(model=model).generate(prompt_token_ids=[PROMPT], sampling_params=greedy(stop=[text[:2]], min_tokens=6))[0]
    assert len(out.token_ids) >= 6 and out.text.startswith(text[:6])


def test_leaving_a_stream_early_aborts_its_requests_and_frees_their_blocks():
    engine_llm = llm()
    stream = engine_llm.stream(prompt_token_ids=[PROMPT, PROMPT[:3]], sampling_params=greedy(30))
    next(stream)
    stream.close()
    assert not engine_llm.engine.has_unfinished_requests() and engine_llm.engine.kv.usage().in_use == 0
    [out] = engine_llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(3))
    assert len(out.token_ids) == 3


def test_forked_samples_survive_preemption_and_recomputation_unchanged():
    model = FakeCausalLM()
    prompts = [PROMPT[: 3 + i] * 2 for i in range(6)]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10)

    def run(num_blocks: int):
        engine_llm = llm(model=model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12)
        outputs = engine_llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return [[c.token_ids for c in o.outputs] for o in outputs], engine_llm.engine.metrics()["preemptions"]

    roomy, calm = run(num_blocks=256)
    tight, preempted = run(num_blocks=14)
    assert calm == 0 and preempted > 0
    assert tight == roomy
    greedy_out = llm(model=model, num_blocks=14, max_num_batched_tokens=12).generate(
        prompt_token_ids=prompts, sampling_params=greedy(10, n=2))
    assert all(c.token_ids == reference_greedy(model, p, 10) for p, o in zip(prompts, greedy_out) for c in o.outputs)


def test_prompt_dicts_as_vllm_takes_them_give_the_same_tokens_as_plain_prompts():
    params = greedy(5)
    plain_ids = llm().generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].token_ids
    plain_text = llm().generate(["hello"], params)[0].token_ids
    assert plain_ids != plain_text  # the two prompts are told apart below
    alone = llm().generate({"prompt_token_ids": PROMPT}, params)
    listed = llm().generate([{"prompt": "hello"}, {"prompt_token_ids": tuple(PROMPT)}, "hello"], params)
    assert alone[0].prompt_token_ids == PROMPT and alone[0].token_ids == plain_ids
    assert [o.token_ids for o in listed] == [plain_text, plain_ids, plain_text]
    assert listed[0].prompt == "hello"


@pytest.mark.parametrize("bad, named", [
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt_ids": [1, 2]}, "prompt_ids not supported"),
    ({}, "got keys none"),
    ([{"prompt": "hi"}, {"multi_modal_data": {}}], "multi_modal_data not supported"),
])
def test_a_prompt_dict_with_other_keys_is_refused_naming_them_before_anything_runs(bad, named):
    engine_llm = llm()
    with pytest.raises(RequestError, match=named):
        engine_llm.generate(bad, greedy(3))
    assert not engine_llm.engine.has_unfinished_requests()
