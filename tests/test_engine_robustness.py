"""The engine says what it runs with, and fails loudly where it used to fail quietly:
a leaking allocator, non-finite logits, a prefix-caching mismatch, a model name
handed to `LLMEngine`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kvforge.core import (
    BlockStateError,
    ConfigError,
    EngineConfig,
    SelectionError,
    build_registry,
    check_implementation_names,
    hookimpl,
    load_config,
)
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams
from kvforge.plugins.block_allocators import PrefixCachingAllocator

sys.path.insert(0, str(Path(__file__).parent))
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step(final_only=True)})
    return final


class _Plugin:
    def __init__(self, *classes):
        self.classes = classes

    @hookimpl
    def kvforge_implementations(self):
        return list(self.classes)


def registry_with(*classes):
    registry = build_registry()
    registry.register_plugin(_Plugin(*classes), "test-robustness")
    return registry


# 1. What was selected


def test_engine_names_the_implementations_it_selected(caplog):
    with caplog.at_level(logging.INFO, logger="kvforge.engine.llm_engine"):
        engine = fake_engine(policy="priority", speculative={"proposer": "ngram", "num_tokens": 2})
    assert engine.selected == {"block_allocator": "default", "scheduler_policy": "priority",
                               "speculative_proposer": "ngram"}
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvforge engine:")]
    assert line == "kvforge engine: block allocator default, scheduler policy priority, speculative proposer ngram"


def test_selected_allocator_follows_the_config():
    engine = fake_engine(prefix_caching=False)
    assert engine.selected["block_allocator"] == "default"  # auto prefers it even with prefix caching off
    config = engine.config.model_copy(update={"cache": engine.config.cache.model_copy(
        update={"allocator": "nocache", "enable_prefix_caching": False})})
    assert LLMEngine(config, model=FakeCausalLM()).selected["block_allocator"] == "nocache"


# 2. Prefix caching against an allocator without it


def nocache_config(**cache):
    return load_config(environ={}, cache={"allocator": "nocache", **cache}).config


def test_config_check_refuses_prefix_caching_with_an_allocator_without_it():
    registry = build_registry()
    with pytest.raises(ConfigError) as excinfo:
        check_implementation_names(nocache_config(), registry)
    message = str(excinfo.value)
    assert "cache.allocator" in message and "'nocache'" in message
    assert "cache.enable_prefix_caching=false" in message
    check_implementation_names(nocache_config(enable_prefix_caching=False), registry)
    check_implementation_names(load_config(environ={}, cache={"allocator": "default"}).config, registry)


def test_engine_refusal_of_the_same_mismatch_says_the_fix():
    config = EngineConfig(device="cpu", cache={"allocator": "nocache", "num_blocks": 16, "block_size": 4})
    with pytest.raises(SelectionError, match=r"cache.enable_prefix_caching=false"):
        LLMEngine(config, model=FakeCausalLM())


# 3. Leak check


class LeakyAllocator(PrefixCachingAllocator):
    """Forgets the last block of every `free` call: it stays held forever."""

    name = "leaky"

    def free(self, block_ids):
        super().free(list(block_ids)[:-1])


def leak_engine(allocator: str) -> LLMEngine:
    config = EngineConfig(device="cpu", dtype="float32", warmup=False,  # its blocks would leak too
                          cache={"allocator": allocator, "num_blocks": 32, "block_size": 4},
                          scheduler={"policy": "fcfs", "max_num_batched_tokens": 32})
    return LLMEngine(config, model=FakeCausalLM(), registry=registry_with(LeakyAllocator))


def test_a_leaking_allocator_is_reported_by_name_once_no_request_is_left():
    engine = leak_engine("leaky")
    with pytest.raises(BlockStateError) as excinfo:
        run_all(engine, {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8]})
    message = str(excinfo.value)
    assert "leak" in message and "'leaky'" in message and "LeakyAllocator" in message
    assert "2 of 32 blocks still held" in message  # one forgotten block per finished request


def test_no_leak_is_reported_for_blocks_left_in_the_prefix_cache():
    engine = leak_engine("default")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    outputs = run_all(engine, {"a": prompt, "b": prompt})
    assert {o.finish_reason for o in outputs.values()} == {"length"}
    usage = engine.kv.usage()
    assert usage.cached > 0 and usage.free == usage.num_blocks  # cached blocks are free, not held


# 4. Non-finite logits


POISON = 13  # the token whose embedding is NaN


def poisoned_model() -> FakeCausalLM:
    model = FakeCausalLM()
    model.embed[POISON] = float("nan")
    return model


def test_non_finite_logits_end_only_that_request_with_an_error():
    model = poisoned_model()
    engine = fake_engine(model)
    clean, poisoned = [1, 2, 3, 4, 5], [1, POISON, 3]
    outputs = run_all(engine, {"clean": clean, "poisoned": poisoned, "clean2": [7, 8]})
    bad = outputs["poisoned"]
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error and bad.token_ids == []
    assert outputs["clean"].token_ids == reference_greedy(model, clean, 6)
    assert outputs["clean2"].token_ids == reference_greedy(model, [7, 8], 6)
    assert engine.metrics()["errors"] == 1
    assert engine.kv.usage().free == engine.num_blocks  # the ended request's blocks went back


def test_non_finite_logits_end_every_sample_of_that_request():
    engine = fake_engine(poisoned_model())
    params = SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=1)
    outputs = run_all(engine, {"poisoned": [POISON, 2, 3], "clean": [4, 5, 6]}, params)
    assert {c.finish_reason for c in outputs["poisoned"].outputs} == {"error"}
    assert {c.finish_reason for c in outputs["clean"].outputs} == {"length"}


def test_finite_logits_whose_sum_overflows_are_not_taken_for_non_finite():
    # The step checks one sum of all logits first; float32 overflow there must not end anything.
    model = FakeCausalLM()
    original = model.compute_logits

    def huge(hidden):
        logits = original(hidden).clone()
        logits[:, :4] = 3e38  # finite, but four of them sum to infinity in float32
        return logits

    model.compute_logits = huge
    outputs = run_all(fake_engine(model), {"a": [1, 2, 3], "b": [4, 5]})
    assert {o.finish_reason for o in outputs.values()} == {"length"}
    assert all(o.error is None and len(o.token_ids) == GREEDY.max_tokens for o in outputs.values())


# 6. A model name handed to LLMEngine


def test_llm_engine_accepts_a_model_name_like_llm():
    from kvforge.models import resolve_model_dir

    if not (resolve_model_dir("kvforge-tiny-draft") / "model.safetensors").is_file():
        pytest.skip("built-in model kvforge-tiny-draft is not shipped in this checkout")
    config = EngineConfig(device="cpu", cache={"num_blocks": 16})
    engine = LLMEngine(config, model="kvforge-tiny-draft")
    assert engine.config.model == "kvforge-tiny-draft" and engine.config.cache.num_blocks == 16
    assert engine.selected["attention_backend"] and engine.tokenizer is not None
    outputs = run_all(engine, {"x": engine.tokenizer.encode("def f(")},
                      SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(outputs["x"].token_ids) == 2


@pytest.mark.parametrize("args, kwargs, expected", [
    (("kvforge-tiny",), {}, r"config must be an EngineConfig.*LLMEngine\(model='kvforge-tiny'\)"),
    ((), {"model": object()}, r"model must be a model name, a model directory or a CausalLM.*got object"),
])
def test_llm_engine_refuses_what_it_cannot_use_at_once(args, kwargs, expected):
    with pytest.raises(TypeError, match=expected):
        LLMEngine(*args, **kwargs)
