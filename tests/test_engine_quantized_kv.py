"""The engine with a quantized KV cache (`cache.kv_cache_dtype` = a quantizer name):
generation, prefix caching, forks and preemption work over quantized blocks; greedy
output stays close to float KV; any registered per_token quantizer works by name;
what cannot work is refused, saying why.

Every CPU backend that declares the storage dtype is tested (found through the
registry, so a backend that learns to read one is picked up without edits here)."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.core import (
    ATTENTION_BACKEND,
    QUANTIZER,
    ConfigError,
    KVCacheSpec,
    SelectionError,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
    load_config,
    quantized_kv_views,
)
from kvforge.engine.model_runner import ModelRunner

KV_QUANTIZERS = ("int8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZE = 8  # small blocks, so the short prompts below span several (and preemption frees some)
MIN_GREEDY_AGREEMENT = 0.75  # measured 2026-11-30: see docs/kv_cache.md


def cpu_backends_reading(quantizer: str) -> list[str]:
    storage = build_registry().select(QUANTIZER, quantizer).cls.storage_dtype
    request = SelectionRequest(device="cpu", dtype=torch.float32, kv_storage_dtype=storage, block_size=BLOCK_SIZE)
    return [c.registration.name for c in build_registry().candidates(ATTENTION_BACKEND, request) if c.usable]


GRID = [(q, b) for q in KV_QUANTIZERS for b in cpu_backends_reading(q)]
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 5 * i)] for i in range(6)]  # 3..28 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tiny(kv_cache_dtype: str, backend: str = "sdpa", warmup: bool = True, **cache) -> LLM:
    return LLM("kvforge-tiny", device="cpu", dtype="float32", warmup=warmup, attention={"backend": backend},
               cache={"block_size": BLOCK_SIZE, "num_blocks": 96, "kv_cache_dtype": kv_cache_dtype, **cache})


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """The fraction of tokens equal at the same position."""
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    return same / sum(len(e) for e in expected)


@pytest.fixture(scope="module")
def float_tokens() -> list[list[int]]:
    return tokens(tiny("auto").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))


def test_every_built_in_kv_quantizer_has_a_cpu_backend_to_test():
    assert {q for q, _ in GRID} == set(KV_QUANTIZERS)
    assert {"reference", "sdpa"} <= {b for _, b in GRID}


@pytest.mark.parametrize("quantizer, backend", GRID)
def test_greedy_output_mostly_agrees_with_float_kv(quantizer, backend, float_tokens):
    llm = tiny(quantizer, backend)
    cache = llm.engine.runner.kv_caches[0]
    spec = llm.engine.model.kv_cache_spec(8)
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (llm.engine.num_blocks, spec.layer_block_bytes())
    got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    assert agreement(got, float_tokens) >= MIN_GREEDY_AGREEMENT
    data, scales = quantized_kv_views(cache, spec)
    assert data.dtype == spec.quantizer.storage_dtype and bool((scales > 0).any())  # really written quantized


@pytest.mark.parametrize("quantizer, backend", GRID)
def test_prefix_hits_and_forked_samples_read_the_same_quantized_blocks(quantizer, backend):
    llm = tiny(quantizer, backend, enable_prefix_caching=True)
    first = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    hits_before = llm.engine.kv.usage().hits
    forked = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        n=3, temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.kv.usage().hits > hits_before
    # Greedy samples that share the prompt's blocks (the partly filled last one copied
    # on write) must all continue exactly as the unshared run: a copy that lost the
    # scales would zero those keys and change the continuation.
    for prompt_tokens, output in zip(first, forked):
        assert [sample.token_ids for sample in output.outputs] == [prompt_tokens] * 3


def test_a_block_copy_that_drops_the_scales_is_caught_by_the_fork_check(monkeypatch):
    def copies_data_only(runner):
        copies = runner.kv.pop_pending_copies()
        data_bytes = runner.model.kv_cache_spec(runner.block_size).data_bytes()
        for src, dst in copies:
            for cache in runner.kv_caches:
                cache[dst, :data_bytes] = cache[src, :data_bytes]
        return len(copies)

    monkeypatch.setattr(ModelRunner, "apply_block_copies", copies_data_only)
    with pytest.raises(AssertionError):
        test_prefix_hits_and_forked_samples_read_the_same_quantized_blocks("int8", "sdpa")


@pytest.mark.parametrize("quantizer, backend", GRID)
def test_preemption_and_recompute_with_a_small_cache_give_the_same_tokens(quantizer, backend):
    roomy = tokens(tiny(quantizer, backend).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    small = tiny(quantizer, backend, num_blocks=10, enable_prefix_caching=False)
    assert tokens(small.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == roomy
    assert small.engine.metrics()["preemptions"] > 0


def test_block_copies_carry_data_and_scales():
    spec = KVCacheSpec(4, 2, 8, torch.float32, quantizer=build_registry().select(QUANTIZER, "int8").cls())
    caches = [torch.randint(0, 256, (6, spec.layer_block_bytes()), dtype=torch.uint8) for _ in range(2)]
    before = [c.clone() for c in caches]

    class PendingCopies:
        def pop_pending_copies(self):
            return [(1, 4), (3, 0)]

    runner = ModelRunner(model=None, kv=PendingCopies(), kv_caches=caches, block_size=4, device="cpu")
    assert runner.apply_block_copies() == 2
    for cache, old in zip(caches, before):
        data, scales = quantized_kv_views(cache, spec)
        old_data, old_scales = quantized_kv_views(old, spec)
        for src, dst in [(1, 4), (3, 0)]:
            assert torch.equal(data[dst].view(torch.uint8), old_data[src].view(torch.uint8))
            assert torch.equal(scales[dst].view(torch.int32), old_scales[src].view(torch.int32))
        assert torch.equal(cache[[2, 5]], old[[2, 5]])  # neither source nor destination: untouched


# Any quantizer by name; what cannot work is refused

THIRD_PARTY_QUANTIZER = '''
import torch
from kvforge.core import PER_TOKEN, QuantizedTensor, Quantizer, hookimpl

SHAPES = []  # what it was asked to quantize, so the test can see it was used


class Int7(Quantizer):
    """Symmetric int8 storage using only -63..63 (a deliberately different quantizer)."""

    name = "thirdparty_int7"
    storage_dtype = torch.int8
    granularity = PER_TOKEN
    error_bound = 1.0 / 120

    def quantize(self, x):
        self.check_finite(x)
        SHAPES.append(tuple(x.shape))
        amax = x.abs().amax(-1, keepdim=True).float()
        scale = torch.where(amax > 0, amax / 63, torch.ones_like(amax))
        return QuantizedTensor((x.float() / scale).round().clamp(-63, 63).to(torch.int8), scale, x.dtype)

    def dequantize(self, q, dtype=None):
        return (q.data.float() * q.scale).to(dtype or q.original_dtype)


@hookimpl
def kvforge_implementations():
    return [Int7]
'''

FLOAT_ONLY_BACKEND = '''
from kvforge.core import AttentionBackend, hookimpl


class FloatOnly(AttentionBackend):
    """Reads float KV caches only; `auto` would prefer it."""

    name = "float-only"
    priority = 1000

    def plan(self, batch):
        return batch

    def forward(self, query, kv_cache, plan, out=None):
        raise AssertionError("a float-only backend must never be run over a quantized cache")


@hookimpl
def kvforge_implementations():
    return [FloatOnly]
'''


def test_a_third_party_quantizer_works_by_name(fake_site, float_tokens):
    import sys

    fake_site.add("fakeplug-int7", "0.3", {"fakeplug_int7": THIRD_PARTY_QUANTIZER}, {"int7": "fakeplug_int7"})
    llm = tiny("thirdparty_int7", "sdpa")
    got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    assert sys.modules["fakeplug_int7"].SHAPES, "the third-party quantizer was never called"
    assert llm.engine.model.kv_cache_spec(8).quantizer.name == "thirdparty_int7"
    assert agreement(got, float_tokens) >= MIN_GREEDY_AGREEMENT


def test_a_float_kv_dtype_other_than_the_model_dtype_is_still_refused():
    with pytest.raises(UnsupportedConfigurationError, match="keeps the KV cache in the model dtype"):
        tiny("bfloat16")
    assert tiny("float32").engine.runner.kv_caches[0].dtype == torch.float32


def test_a_per_channel_quantizer_is_refused_for_the_kv_cache():
    with pytest.raises(ConfigError) as excinfo:
        tiny("int8_weight")
    message = str(excinfo.value)
    assert "'int8_weight' has granularity 'per_channel'" in message
    assert "one scale per token and KV head" in message
    assert "qualify: fp8_e4m3, fp8_e4m3_per_tensor, fp8_e5m2, fp8_e5m2_per_tensor, int8" in message


def test_an_unknown_kv_cache_dtype_lists_the_valid_names():
    with pytest.raises(SelectionError, match=r"cache.kv_cache_dtype = 'int9'.*fp8_e4m3.*did you mean 'int8'"):
        tiny("int9")


def test_a_backend_that_cannot_read_the_storage_dtype_is_refused_with_reasons(fake_site):
    fake_site.add("fakeplug-floatonly", "1.0", {"fakeplug_floatonly": FLOAT_ONLY_BACKEND},
                  {"floatonly": "fakeplug_floatonly"})
    with pytest.raises(SelectionError) as excinfo:
        tiny("int8", "float-only")
    assert "'float-only' cannot serve this configuration" in str(excinfo.value)
    assert "cannot read a KV cache quantized to int8 (quantized KV dtypes it reads: none)" in str(excinfo.value)
    chosen = tiny("int8", "auto").engine.model.attention_backend.name
    assert chosen != "float-only"
    # float: it would be chosen (warmup off: this test backend fails if it ever runs)
    assert tiny("auto", "auto", warmup=False).engine.model.attention_backend.name == "float-only"


def test_plugins_explain_shows_the_backend_refused_for_the_kv_dtype(fake_site):
    from kvforge.cli_plugins import report, selection_request

    fake_site.add("fakeplug-floatonly", "1.0", {"fakeplug_floatonly": FLOAT_ONLY_BACKEND},
                  {"floatonly": "fakeplug_floatonly"})
    registry = build_registry(environ={})
    config = load_config(environ={}, device="cpu", cache={"kv_cache_dtype": "fp8_e5m2"}).config
    verdict = report(registry, selection_request(config, registry), explain=True)["explain"][ATTENTION_BACKEND]
    why_not = {c["name"]: c["why_not"] for c in verdict["candidates"]}
    assert "cannot read a KV cache quantized to float8_e5m2" in why_not["float-only"]
    assert verdict["chosen"] != "float-only"


def test_a_model_refuses_a_quantizer_its_backend_cannot_read(fake_site):
    from kvforge.models import load_model

    fake_site.add("fakeplug-floatonly", "1.0", {"fakeplug_floatonly": FLOAT_ONLY_BACKEND},
                  {"floatonly": "fakeplug_floatonly"})
    registry = build_registry(environ={})
    backend = registry.get(ATTENTION_BACKEND, "float-only").cls
    int8 = registry.select(QUANTIZER, "int8").cls()
    with pytest.raises(UnsupportedConfigurationError, match="cannot read a KV cache quantized to int8"):
        load_model("kvforge-tiny", attention_backend=backend, kv_quantizer=int8)
    model = load_model("kvforge-tiny", attention_backend=backend)
    with pytest.raises(UnsupportedConfigurationError, match="float-only"):
        model.set_kv_quantizer(int8)
    assert model.kv_quantizer is None and not model.kv_cache_spec(8).quantized  # left as it was


def test_a_model_refuses_a_per_channel_kv_quantizer():
    from kvforge.models import load_model

    model = load_model("kvforge-tiny")
    with pytest.raises(ConfigError, match="one scale per token and KV head; use a per_token or static-scale quantizer"):
        model.set_kv_quantizer(build_registry().select(QUANTIZER, "int8_weight").cls())
    assert model.kv_quantizer is None


# A model built from a transformers config, head size 64

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama64")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def llama(path, kv_cache_dtype: str, backend: str = "sdpa", **cache) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", attention={"backend": backend},
               cache={"block_size": 16, "kv_cache_dtype": kv_cache_dtype, **cache},
               scheduler={"max_num_batched_tokens": 64})


@pytest.mark.parametrize("quantizer", KV_QUANTIZERS)
def test_transformers_model_picks_the_same_next_token_as_float_kv_mostly(llama_dir, quantizer):
    """A random-weight model's greedy continuations fork at the first near-tie, so the
    comparison is per step: the next token after 48 prefixes (4..48 tokens) of random text."""
    rng = random.Random(1)
    texts = [[rng.randrange(256) for _ in range(48)] for _ in range(4)]
    prompts = [text[:n] for text in texts for n in range(4, 49, 4)]
    one = SamplingParams(temperature=0, max_tokens=1)
    expected = tokens(llama(llama_dir, "auto", num_blocks=128).generate(prompt_token_ids=prompts, sampling_params=one))
    for backend in cpu_backends_reading(quantizer):
        got = tokens(llama(llama_dir, quantizer, backend, num_blocks=128).generate(prompt_token_ids=prompts,
                                                                                  sampling_params=one))
        assert agreement(got, expected) >= MIN_GREEDY_AGREEMENT, backend


def test_same_budget_holds_over_3_5_times_the_blocks_at_head_size_64(llama_dir):
    budget = {"memory_budget": "1MiB"}
    float32 = llama(llama_dir, "auto", **budget).engine
    assert float32.model.layer_specs[0].head_size == 64
    for quantizer in KV_QUANTIZERS:
        quantized = llama(llama_dir, quantizer, **budget).engine
        assert quantized.num_blocks >= 3.5 * float32.num_blocks, quantizer

