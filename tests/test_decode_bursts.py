"""Multi-step decoding (`scheduler.num_scheduler_steps`, engine/decode_bursts.py).

A burst runs several decode steps per scheduler step: in one C++ call where the
decoder stack runs its LM head (`DecoderStack.decode_greedy`, or
`decode_sampled` when a request samples), else pass by pass in Python
(`ModelRunner.execute_next`). Either way every request
must get token for token what one step at a time gives it, with the same finish
and stop reasons: each test runs the same requests through an engine with
bursts and one without, and checks the bursts did run (fewer engine steps, the
path expected), so an engine that ignored the setting would fail."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from kvforge import LLMEngine, SamplingParams
from kvforge.core import ConfigError, load_config
from kvforge.engine import decode_bursts
from kvforge.engine.metrics import EngineMetrics
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.request import Request
from kvforge.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvforge.engine.step_sampling import StepSampler
from kvforge.models.cpp_decoder_stack import CppDecoderStack
from kvforge.models.cpp_linear import cpp_linear_unavailable

CPP = cpp_linear_unavailable(torch.float32, torch.device("cpu")) is None
needs_cpp = pytest.mark.skipif(not CPP, reason="kvforge's C++ library cannot be built here")
VOCAB = 96


def save_llama(path, tied: bool, max_positions: int = 256, seed: int = 0) -> str:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=tied,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("untied"), tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("tied"), tied=True)


WEIGHTS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8-weight-only": dict(dtype="float32", quantization={"weights": "int8_weight"}),
    "int8-w8a8": dict(dtype="float32", quantization={"weights": "int8_weight", "activations": "int8"}),
}


def make_engine(model: str, steps: int, block_size: int = 4, num_blocks: int | None = None, **options) -> LLMEngine:
    cache = {"block_size": block_size, "enable_prefix_caching": options.pop("prefix_caching", False)}
    if num_blocks is not None:
        cache["num_blocks"] = num_blocks
    else:
        cache["memory_budget"] = 2**24
    config = load_config(model=model, device="cpu", cache=cache, warmup=False,
                         scheduler={"num_scheduler_steps": steps, "max_num_seqs": options.pop("max_num_seqs", 8),
                                    # bursts as long as the count allows, however slow the host: the time
                                    # limit has tests of its own
                                    "max_burst_s": options.pop("max_burst_s", 60.0)},
                         **{"dtype": "float32", **options}).config
    return LLMEngine(config)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 6, 11]))] for _ in range(count)]


def run(engine: LLMEngine, requests: list[tuple[list[int] | str, SamplingParams]]) -> dict:
    """Every request's streamed tokens (the deltas of each step's outputs, joined),
    final tokens, text, finish and stop reasons."""
    for i, (prompt, params) in enumerate(requests):
        if isinstance(prompt, str):
            engine.add_request(f"q{i}", prompt, params)
        else:
            engine.add_request(f"q{i}", prompt_token_ids=prompt, params=params)
    streamed: dict[str, list[int]] = {}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out.outputs[0]
            seen = streamed.setdefault(out.request_id, [])
            assert done.token_ids[:len(seen)] == seen, "a streamed token changed"
            streamed[out.request_id] = list(done.token_ids)
            if out.finished:
                final[out.request_id] = (list(done.token_ids), done.text, str(done.finish_reason), done.stop_reason)
    assert {rid: tokens for rid, (tokens, *_) in final.items()} == streamed
    return final


def count_calls(monkeypatch, owner, name: str) -> dict:
    """Counts `owner.name`'s calls and those that returned something other than None."""
    counts = {"calls": 0, "ran": 0}
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        counts["calls"] += 1
        counts["ran"] += result is not None
        return result

    monkeypatch.setattr(owner, name, counted)
    return counts


def compare(model: str, requests, steps: int = 5, **options) -> tuple[dict, LLMEngine, LLMEngine]:
    """The requests through an engine without bursts and one with; asserts the same results."""
    one, burst = make_engine(model, 1, **dict(options)), make_engine(model, steps, **dict(options))
    expected, got = run(one, requests), run(burst, requests)
    assert got == expected
    return got, one, burst


@needs_cpp
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("head", ["untied", "tied"])
def test_greedy_bursts_run_in_one_cpp_call_and_give_one_step_at_a_time_tokens(weights, head, request, monkeypatch):
    model = request.getfixturevalue(head)
    cpp = count_calls(monkeypatch, CppDecoderStack, "greedy_burst")
    python = count_calls(monkeypatch, ModelRunner, "execute_next")
    lengths = [1, 2, 7, 19, 33, 40]  # 1 and 2: no burst or a burst of one; the rest cross several 4-token blocks
    requests = [(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts(len(lengths)), lengths)]
    got, one, burst = compare(model, requests, steps=5, **WEIGHTS[weights])
    assert [len(tokens) for tokens, *_ in got.values()] == lengths
    assert cpp["ran"] > 0 and cpp["ran"] == cpp["calls"] and python["calls"] == 0
    assert burst.stats.num_steps < one.stats.num_steps / 2
    assert burst.stats.num_generated_tokens == one.stats.num_generated_tokens == sum(lengths)


@needs_cpp
def test_a_stack_without_its_head_runs_bursts_pass_by_pass(untied, monkeypatch):
    # an LM head the C++ class does not run: the same bursts, in Python
    monkeypatch.setattr("kvforge.models.cpp_decoder_stack.head_entry", lambda model: (None, "a head it cannot run"))
    cpp = count_calls(monkeypatch, CppDecoderStack, "greedy_burst")
    python = count_calls(monkeypatch, ModelRunner, "execute_next")
    requests = [(p, SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)) for p in prompts(3)]
    _, one, burst = compare(untied, requests, steps=6)
    assert cpp["calls"] == 0 and python["calls"] > 0
    assert burst.stats.num_steps < one.stats.num_steps / 2


SAMPLED = [SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True),  # its own generator
           SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, ignore_eos=True),  # the engine's
           SamplingParams(max_tokens=17, temperature=0.7, top_k=5, ignore_eos=True),
           SamplingParams(max_tokens=19, temperature=1.2, min_p=0.1, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)]  # greedy beside sampled ones


@needs_cpp
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8-weight-only"])
def test_sampled_bursts_run_in_one_cpp_call_with_the_same_draws(untied, weights, monkeypatch):
    # Every pass's uniform numbers are drawn before the call, from the same generators
    # in the same order as pass by pass: the same tokens as one step at a time.
    cpp = count_calls(monkeypatch, CppDecoderStack, "sampled_burst")
    python = count_calls(monkeypatch, ModelRunner, "execute_next")
    requests = list(zip(prompts(len(SAMPLED), seed=5), SAMPLED))
    _, one, burst = compare(untied, requests, steps=4, **WEIGHTS[weights])
    assert cpp["ran"] > 0 and cpp["ran"] == cpp["calls"] and python["calls"] == 0
    assert burst.stats.num_steps < one.stats.num_steps / 2


def test_sampled_requests_burst_pass_by_pass_with_the_same_draws(untied, monkeypatch):
    # an LM head the C++ class does not run: the same bursts, in Python
    monkeypatch.setattr("kvforge.models.cpp_decoder_stack.head_entry", lambda model: (None, "a head it cannot run"))
    python = count_calls(monkeypatch, ModelRunner, "execute_next")
    requests = list(zip(prompts(len(SAMPLED), seed=5), SAMPLED))
    _, one, burst = compare(untied, requests, steps=4)
    assert python["calls"] > 0
    assert burst.stats.num_steps < one.stats.num_steps / 2


@needs_cpp
def test_a_sampled_burst_cut_short_leaves_the_generators_where_its_passes_left_them(untied, monkeypatch):
    # Stop tokens end bursts early and a burst's time can end it after any pass: the
    # numbers drawn for the passes that did not run must be given back, or every
    # later token of a seeded request would shift. Seeded requests only: an unseeded
    # one's draws depend on what shares its steps, which a stop changes.
    cpp = count_calls(monkeypatch, CppDecoderStack, "sampled_burst")
    reference = run(make_engine(untied, 1), [(prompts(1)[0], SamplingParams(max_tokens=40, temperature=0.9, seed=5,
                                                                             ignore_eos=True))])
    tokens = reference["q0"][0]
    stop = next(t for i, t in enumerate(tokens) if i >= 9 and t not in tokens[:i])
    requests = [(prompts(1)[0], SamplingParams(max_tokens=40, temperature=0.9, seed=5, stop_token_ids=[stop])),
                (prompts(2)[1], SamplingParams(max_tokens=33, temperature=1.1, top_p=0.8, seed=6, ignore_eos=True)),
                (prompts(3)[2], SamplingParams(max_tokens=29, temperature=0.6, seed=8, ignore_eos=True))]
    got, _, _ = compare(untied, requests, steps=7)
    assert got["q0"][0][-1] == stop and got["q0"][2] == "stop"
    assert cpp["ran"] > 0
    # Time limits: every burst one pass of the 7 drawn for (6 given back each time), then
    # cuts wherever 0.3 ms of the host's time falls.
    for limit in (1e-9, 3e-4):
        assert run(make_engine(untied, 7, max_burst_s=limit), requests) == got, limit


def test_stop_tokens_and_max_tokens_end_a_burst_where_one_step_at_a_time_ends(untied):
    reference = run(make_engine(untied, 1), [(prompts(1)[0], SamplingParams(max_tokens=40, temperature=0,
                                                                             ignore_eos=True))])
    tokens = reference["q0"][0]
    stop = next(t for i, t in enumerate(tokens) if i >= 9 and t not in tokens[:i])  # first seen mid-burst
    requests = [(prompts(1)[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop])),
                (prompts(1)[0], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)),
                (prompts(2)[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    got, _, _ = compare(untied, requests, steps=7)
    assert got["q0"][0][-1] == stop and got["q0"][2] == "stop" and got["q0"][3] == stop
    assert len(got["q1"][0]) == 13 and got["q1"][2] == "length"


def test_the_models_context_ends_a_burst_where_one_step_at_a_time_ends(tmp_path):
    model = save_llama(tmp_path / "short", tied=False, max_positions=30)
    requests = [(p, SamplingParams(max_tokens=100, temperature=t, seed=1, ignore_eos=True))
                for p, t in zip(prompts(3), (0.0, 0.9, 0.0))]
    got, _, _ = compare(model, requests, steps=8)
    for i, (prompt, _) in enumerate(requests):
        tokens, _, reason, _ = got[f"q{i}"]
        assert reason == "length" and len(prompt) + len(tokens) == 31  # the last token needs no position


def test_eos_and_stop_strings_end_a_burst_where_one_step_at_a_time_ends():
    texts = ["Once upon a time", "def area(w, h):\n", "The cat sat on the mat. The cat", "x = 1\ny = 2\n"]
    reference = run(make_engine("kvforge-tiny", 1, block_size=16),
                    [(t, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)) for t in texts])
    stops = []
    for tokens, text, _, _ in reference.values():  # a piece of each text from its middle: a stop string
        middle = text[len(text) // 2:len(text) // 2 + 3]
        stops.append(middle if middle.strip() else None)
    requests = [(t, SamplingParams(max_tokens=60, temperature=0, stop=[s] if s else None))
                for t, s in zip(texts, stops)]
    requests += [(t, SamplingParams(max_tokens=80, temperature=0)) for t in texts]  # EOS not ignored
    got, one, burst = compare("kvforge-tiny", requests, steps=8, block_size=16)
    assert any(reason == "stop" for _, _, reason, stop in got.values() if isinstance(stop, str))
    assert burst.stats.num_steps < one.stats.num_steps


PENALISED = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                           frequency_penalty=2.0, presence_penalty=2.0),
             SamplingParams(max_tokens=20, temperature=0.9, seed=2, ignore_eos=True, repetition_penalty=0.8,
                            presence_penalty=0.5),
             SamplingParams(max_tokens=22, temperature=1.1, top_k=20, ignore_eos=True, frequency_penalty=0.7),
             SamplingParams(max_tokens=18, temperature=0.7, seed=9, ignore_eos=True)]  # beside one without


@needs_cpp
@pytest.mark.parametrize("greedy_only", [True, False])
def test_penalised_requests_burst_in_cpp_with_their_history_growing_pass_by_pass(untied, greedy_only, monkeypatch):
    # Repetition, presence and frequency penalties read every token so far: the C++
    # burst adds each pass's token to the request's history, as one step at a time does.
    cpp = count_calls(monkeypatch, CppDecoderStack, "sampled_burst")
    chosen = PENALISED[:1] if greedy_only else PENALISED  # greedy alone: no numbers drawn
    requests = list(zip(prompts(len(chosen), seed=8), chosen))
    got, one, burst = compare(untied, requests, steps=6)
    assert cpp["ran"] > 0 and cpp["ran"] == cpp["calls"]
    assert burst.stats.num_steps < one.stats.num_steps / 2
    plain = run(make_engine(untied, 6), [(p, SamplingParams(**{**params.__dict__, "repetition_penalty": 1.0,
                                                                 "presence_penalty": 0.0, "frequency_penalty": 0.0}))
                                         for p, params in requests])
    assert plain["q0"][0] != got["q0"][0]  # the penalties do change the tokens


def test_penalised_requests_step_one_pass_at_a_time_without_a_cpp_burst(untied, monkeypatch):
    monkeypatch.setattr("kvforge.models.cpp_decoder_stack.head_entry", lambda model: (None, "a head it cannot run"))
    requests = list(zip(prompts(len(PENALISED), seed=8), PENALISED))
    _, one, burst = compare(untied, requests, steps=6)
    assert burst.stats.num_steps == one.stats.num_steps


def test_requests_that_read_their_history_never_burst(untied):
    # logprobs: every step is scheduled; min_tokens: bursts once it is reached
    logprobs = [(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)) for p in prompts(2)]
    _, one, burst = compare(untied, logprobs, steps=6)
    assert burst.stats.num_steps == one.stats.num_steps
    late = [(prompts(1)[0], SamplingParams(max_tokens=40, temperature=0, min_tokens=20))]
    _, one, burst = compare(untied, late, steps=6)
    assert one.stats.num_steps - 15 >= burst.stats.num_steps >= 20


def test_a_cache_without_room_for_a_burst_runs_single_steps_and_loses_nothing(untied):
    # 12 blocks of 4 tokens for 3 requests of up to 17 tokens: reservations fail, preemptions happen
    requests = [(p, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)) for p in prompts(3, seed=9)]
    got, one, burst = compare(untied, requests, steps=8, num_blocks=12)
    assert all(len(tokens) == 14 for tokens, *_ in got.values())
    assert burst.kv.usage().in_use == 0
    assert burst.stats.num_steps < one.stats.num_steps


def test_prefix_caching_and_samples_forked_from_one_prompt_burst_alike(untied):
    shared = prompts(1, seed=3)[0] * 4  # 24 tokens: whole blocks for the cache to share
    requests = [(shared, SamplingParams(max_tokens=18, temperature=0.9, seed=4, n=3, ignore_eos=True)),
                (shared + [5], SamplingParams(max_tokens=22, temperature=0, ignore_eos=True))]
    got, one, burst = compare(untied, requests, steps=5, prefix_caching=True)
    assert burst.stats.num_steps < one.stats.num_steps
    assert burst.kv.usage().in_use == 0


@needs_cpp
def test_a_non_finite_step_inside_a_burst_ends_the_request_as_one_step_at_a_time_does(untied):
    # A token whose embedding row is NaN: the step that reads it has non-finite logits.
    reference = run(make_engine(untied, 1), [(prompts(1)[0], SamplingParams(max_tokens=30, temperature=0,
                                                                             ignore_eos=True))])
    tokens = reference["q0"][0]
    index = next(i for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i] and t not in prompts(1)[0])
    results = {}
    for steps in (1, 8):
        engine = make_engine(untied, steps)
        engine.model.model.embed_tokens.weight.data[tokens[index]] = float("nan")
        engine.add_request("q", prompt_token_ids=prompts(1)[0],
                           params=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[steps] = (out.outputs[0].token_ids, str(out.outputs[0].finish_reason),
                                      out.outputs[0].error)
    assert results[8] == results[1]
    assert results[1][0] == tokens[:index + 1] and results[1][1] == "error"


def test_a_python_burst_drops_the_pass_whose_logits_are_not_finite():
    class Runner:  # logits whose first maximum is each pass's token; NaN on the pass named
        def __init__(self, tokens, nan_at):
            self.tokens, self.nan_at, self.passes = tokens, nan_at, 0

        def logits(self):
            row = torch.zeros(1, 8)
            row[0, self.tokens[self.passes]] = 1.0
            if self.passes == self.nan_at:
                row[0, 3] = float("nan")
            self.passes += 1
            return row

        def execute(self, scheduled, lora_slots=None):
            return self.logits()

        def execute_next(self, scheduled, tokens, lora_slots=None):
            assert tokens == [self.tokens[self.passes - 1]]  # fed the token the pass before sampled
            return self.logits()

        def greedy_burst(self, scheduled, steps, stop_ids, max_seconds):
            return None

    request = Request("r", [1, 2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    request.output_token_ids.append(4)
    plan = SchedulerOutput([ScheduledRequest(request, 2, 1)])
    sampler = StepSampler(0, EngineMetrics())
    out = decode_bursts.run_burst(Runner([5, 6, 7, 1, 2], nan_at=3), sampler, plan, 5, None, 60.0)
    assert out.tokens["r"].token_ids == [5, 6, 7] and not out.non_finite
    out = decode_bursts.run_burst(Runner([5, 6], nan_at=0), sampler, plan, 5, None, 60.0)
    assert out.non_finite == ["r"] and not out.tokens
    out = decode_bursts.run_burst(Runner([5, 6, 7, 1, 2], nan_at=-1), sampler, plan, 5, None, 60.0)
    assert out.tokens["r"].token_ids == [5, 6, 7, 1, 2]


def test_burst_length_is_capped_by_max_tokens_and_the_context():
    def entry(output: int, max_tokens: int, prompt: int = 3, greedy: bool = True):
        request = Request("r", list(range(prompt)), SamplingParams(max_tokens=max_tokens,
                                                                   temperature=0 if greedy else 1.0))
        request.output_token_ids.extend([1] * output)
        return ScheduledRequest(request, request.num_tokens - 1, 1)

    assert decode_bursts.burst_length([entry(1, 100)], 8, 1000) == 8
    assert decode_bursts.burst_length([entry(1, 100), entry(5, 8)], 8, 1000) == 3  # 3 tokens left
    assert decode_bursts.burst_length([entry(1, 100, prompt=10)], 8, 14) == 4  # positions 10, 11, 12 and 13
    assert decode_bursts.burst_length([entry(0, 100)], 8, 1000) == 1  # its first token: never a burst
    assert decode_bursts.burst_length([entry(1, 100)], 1, 1000) == 1
    prefill = entry(1, 100)
    prefill.num_tokens, prefill.start = 2, prefill.start - 1
    assert decode_bursts.burst_length([prefill], 8, 1000) == 1


def test_speculation_bursts_only_the_steps_it_drafts_nothing_on(untied):
    # ngram on text it cannot predict: adaptive drafting turns itself down, and those
    # steps burst (test_adaptive_speculation.py has the policy's side); output unchanged.
    requests = [(p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)) for p in prompts(2, seed=11)]
    expected = run(make_engine(untied, 1), requests)
    spec = {"proposer": "ngram", "num_tokens": 3}
    stepped = make_engine(untied, 1, speculative=spec)
    burst = make_engine(untied, 8, speculative=spec)
    assert run(stepped, requests) == expected == run(burst, requests)
    assert burst.stats.num_steps < stepped.stats.num_steps


def test_num_scheduler_steps_is_checked():
    with pytest.raises((ConfigError, ValueError), match="num_scheduler_steps"):
        load_config(model="kvforge-tiny", scheduler={"num_scheduler_steps": 0})
    with pytest.raises((ConfigError, ValueError), match="max_burst_s"):
        load_config(model="kvforge-tiny", scheduler={"max_burst_s": 0})


def test_bursts_are_on_by_default_and_bounded_in_time():
    scheduler = load_config(model="kvforge-tiny").config.scheduler
    assert scheduler.num_scheduler_steps > 1 and 0 < scheduler.max_burst_s <= 0.05
    engine = LLMEngine(load_config(model="kvforge-tiny", warmup=False).config)
    assert engine.max_burst == scheduler.num_scheduler_steps


def test_a_python_burst_ends_after_the_pass_that_reaches_its_time(monkeypatch):
    class Runner:  # every pass takes 4 ms of a clock that only passes moves
        now = 0.0

        def logits(self):
            Runner.now += 0.004
            return torch.ones(1, 8)

        def execute(self, scheduled, lora_slots=None):
            return self.logits()

        def execute_next(self, scheduled, tokens, lora_slots=None):
            return self.logits()

        def greedy_burst(self, scheduled, steps, stop_ids, max_seconds):
            return None

    monkeypatch.setattr(decode_bursts.time, "perf_counter", lambda: Runner.now)
    request = Request("r", [1, 2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    request.output_token_ids.append(4)
    plan = SchedulerOutput([ScheduledRequest(request, 2, 1)])
    sampler = StepSampler(0, EngineMetrics())
    for limit, passes in ((0.01, 3), (0.012, 3), (0.0121, 4), (1e-9, 1), (60.0, 8)):
        out = decode_bursts.run_burst(Runner(), sampler, plan, 8, None, limit)
        assert len(out.tokens["r"].token_ids) == passes, limit


@pytest.mark.parametrize("greedy", [True, False])
def test_a_burst_whose_time_is_up_after_one_pass_is_one_step(untied, greedy, monkeypatch):
    # The C++ burst's clock is its own: a limit no pass can stay under makes every burst one pass.
    cpp = count_calls(monkeypatch, CppDecoderStack, "greedy_burst" if greedy else "sampled_burst")
    requests = [(p, SamplingParams(max_tokens=15, temperature=0 if greedy else 0.9, seed=3, ignore_eos=True))
                for p in prompts(3)]
    _, one, burst = compare(untied, requests, steps=8, max_burst_s=1e-9)
    assert burst.stats.num_steps == one.stats.num_steps
    assert cpp["ran"] > 0 if CPP else cpp["ran"] == 0


def test_no_burst_runs_while_another_request_waits(untied, monkeypatch):
    # One slot: the second request waits until the first ends, so the first decodes
    # one token per step; the second then runs alone, in bursts.
    requests = [(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in prompts(2)]
    engine = make_engine(untied, 8, max_num_seqs=1)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"q{i}", prompt_token_ids=prompt, params=params)
    grown: dict[str, list[int]] = {"q0": [], "q1": []}
    seen = {"q0": 0, "q1": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            grown[out.request_id].append(count - seen[out.request_id])
            seen[out.request_id] = count
    assert seen == {"q0": 20, "q1": 20}
    assert set(grown["q0"]) == {1}
    assert max(grown["q1"]) > 1


@pytest.mark.slow
def test_bursts_run_on_a_tensor_parallel_engine_pass_by_pass(untied):
    # a rank's shard has no C++ stack: every pass goes to the worker as a step of its own
    requests = [(p, SamplingParams(max_tokens=n, temperature=t, seed=2, ignore_eos=True))
                for p, n, t in zip(prompts(3, seed=4), (12, 17, 9), (0.0, 0.8, 0.0))]
    results, steps = [], []
    for burst in (1, 5):
        engine = make_engine(untied, burst, parallel={"tensor_parallel_size": 2, "collective_timeout_s": 60})
        try:
            results.append(run(engine, requests))
            steps.append(engine.stats.num_steps)
        finally:
            engine.shutdown()
    assert results[1] == results[0]
    assert steps[1] < steps[0] / 2


@pytest.mark.slow
def test_a_server_streams_bursts_that_add_up_to_the_offline_texts():
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from serve_process import openai_client, running_server

    from kvforge import LLM

    texts = [f"def f{i}(x):\n    return" for i in range(8)]
    expected = [o.text for o in LLM(model="kvforge-tiny").generate(texts, SamplingParams(temperature=0,
                                                                                       max_tokens=40))]

    async def one(client, prompt: str) -> tuple[list[str], str | None]:
        pieces, reason = [], None
        stream = await client.completions.create(model="kvforge-tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return pieces, reason

    async def main(server):
        client = openai_client(server, async_=True)
        try:
            return await asyncio.gather(*(one(client, p) for p in texts))
        finally:
            await client.close()

    with running_server("--set", "scheduler.num_scheduler_steps=8") as server:
        results = asyncio.run(main(server))
    assert ["".join(pieces) for pieces, _ in results] == expected
    assert all(reason in ("length", "stop") for _, reason in results)
    assert sum(len(pieces) for pieces, _ in results) < 8 * 40 / 2  # chunks of several tokens: bursts ran


def test_a_burst_that_feeds_the_wrong_position_is_caught(untied, monkeypatch):
    # The comparison the tests above make, against a broken burst: each pass after the
    # first rewrites the first pass's position instead of moving on. It must fail.
    from kvforge.engine.decode_inputs import DecodeInputs

    def stuck(self, tokens, device):
        tables, starts = self._last
        return self._plain(tokens, starts, tables, device)

    monkeypatch.setattr(DecodeInputs, "advance", stuck)
    monkeypatch.setattr("kvforge.models.cpp_decoder_stack.head_entry", lambda model: (None, "Python passes only"))
    requests = [(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in prompts(2)]
    with pytest.raises(AssertionError):
        compare(untied, requests, steps=5)
