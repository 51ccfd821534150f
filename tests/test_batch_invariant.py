"""Batch-invariant mode (`batch_invariant = true`): a request's greedy tokens, seeded
samples and logprobs are bitwise the same alone, in a batch, under chunked prefill and
with prefix-cache hits; the kernels it relies on keep each row's sums in one order; the
conformance group catches a backend that declares the guarantee and breaks it; what the
mode does not cover is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.conformance.attention_cases import Target, check_case, make_case, make_layer
from kvforge.conformance.check_attention_batch_invariance import run_hypothesis
from kvforge.core import ATTENTION_BACKEND, SelectionError, UnsupportedConfigurationError, build_registry, cdiv
from tests.planted.attention_backends import SplitKVByBatchSize

PROMPTS = [
    "The capital of France is a city where many people live and work, and the river runs through it while",
    "Once upon a time, there was a little girl who lived in a village near the forest. Every day she",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
]
MAX_TOKENS = 16


def cpp_backend(name: str) -> type:
    registration = build_registry().get(ATTENTION_BACKEND, name)
    if not registration.availability().ok:
        pytest.skip(f"{name} unavailable here: {registration.availability().reason}")
    return registration.cls


# The contract and its conformance group


def test_cpp_batch_invariant_passes_the_conformance_group():
    run_hypothesis(Target(cpp_backend("cpp_batch_invariant"), "cpu", reduced=False), max_examples=6)


def test_a_backend_whose_split_kv_follows_the_batch_is_caught():
    planted = Target(SplitKVByBatchSize, "cpu", reduced=False)
    # Right to within tolerance, so only the invariance check can tell.
    assert check_case(planted, make_case("mixed", make_layer(64, 4), 8, torch.float32, seed=5)) is None
    with pytest.raises(AssertionError, match="differ from alone, one step"):
        run_hypothesis(planted, max_examples=6, shrink=False)


def test_the_default_cpp_tiles_are_not_batch_invariant():
    """What the mode is for: the fast tiles give a prefill row other bits than its decode."""
    with pytest.raises(AssertionError, match="differ"):
        run_hypothesis(Target(cpp_backend("cpp"), "cpu", reduced=False), max_examples=12, shrink=False)


# The kernels the mode runs the model on


def invariant_attention(query, cache, block_table, context: int, sliding_window: int = 0,
                        kv_scales=None) -> torch.Tensor:
    """The cpp kernel's batch-invariant attention of `query`'s tokens, at positions
    context .. context + len(query) - 1 of one sequence."""
    out = torch.empty_like(query)
    n = query.shape[0]
    torch.ops.kvforge_cpp.paged_attention(
        query.contiguous(), cache, torch.tensor([0, n], dtype=torch.int32), torch.tensor([context + n], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32), block_table, 0.125, sliding_window, 0.0, None, out, kv_scales, True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, head_size, sliding_window", [(8, 64, 0), (32, 80, 0), (4, 16, 0), (8, 64, 37)])
def test_a_decode_row_has_the_bits_of_the_same_token_inside_a_prompt_chunk(dtype, heads, head_size, sliding_window):
    """Decodes (1 query token: 1 to 8 rows per KV head) run kernels/narrow_rows.h with keys
    in the lanes; prompt chunks of 16 rows and more the prefill tile with rows in the
    lanes. Every token of a prompt spanning several 48-key tiles, as a decode after its
    context, gives the bits of its row in the whole prompt and in chunks of 5 tokens."""
    from kvforge.kernels import build

    cpp_backend("cpp_batch_invariant")
    build.load()
    gen = torch.Generator().manual_seed(7)
    length, kv_heads, block_size = 150, 4, 16
    blocks = cdiv(length, block_size)
    cache = torch.randn(blocks + 3, 2, block_size, kv_heads, head_size, generator=gen).to(dtype)
    block_table = torch.randperm(blocks + 3, generator=gen)[:blocks].to(torch.int32).view(1, -1)
    # Some rows whose scores climb past the running maximum, so tiles rescale.
    query = (torch.randn(length, heads, head_size, generator=gen) * torch.linspace(0.5, 4, length)[:, None, None])
    query = query.to(dtype)
    prompt = invariant_attention(query, cache, block_table, 0, sliding_window)
    chunks = torch.cat([invariant_attention(query[i:i + 5], cache, block_table, i, sliding_window)
                        for i in range(0, length, 5)])
    differing = [i for i in range(length)
                 if not torch.equal(invariant_attention(query[i:i + 1], cache, block_table, i, sliding_window)[0],
                                    prompt[i])]
    assert differing == [], f"decodes of tokens {differing[:10]} differ from their rows in the prompt"
    assert torch.equal(chunks, prompt), "chunks of 5 tokens differ from the whole prompt"
    # and both are the attention itself, against float64
    keys = cache[block_table[0].long(), 0].reshape(-1, kv_heads, head_size)[:length].double()
    values = cache[block_table[0].long(), 1].reshape(-1, kv_heads, head_size)[:length].double()
    group = heads // kv_heads
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys.repeat_interleave(group, 1)) * 0.125
    position = torch.arange(length)
    hidden = position[None, :] > position[:, None]
    if sliding_window:
        hidden |= position[None, :] <= position[:, None] - sliding_window
    reference = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                             values.repeat_interleave(group, 1))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (prompt.double() - reference).abs().max().item() < tolerance



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_linear_and_rms_norm_rows_do_not_depend_on_the_row_count(dtype):
    from kvforge.models.cpp_linear import CppLinear, cpp_linear_unavailable

    if cpp_linear_unavailable(dtype, torch.device("cpu")) is not None:
        pytest.skip(cpp_linear_unavailable(dtype, torch.device("cpu")))
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(384, 1024, generator=gen) / 32).to(dtype)
    x = torch.randn(300, 1024, generator=gen).to(dtype)
    layer = CppLinear(weight, None)
    norm_weight = torch.randn(1024, generator=gen).to(dtype)
    batched, normed = layer(x), torch.ops.kvforge_cpp.rms_norm(x, norm_weight, 1e-6)
    for rows in (1, 2, 3, 7, 16, 33, 100):
        assert torch.equal(layer(x[:rows]), batched[:rows]), f"linear rows differ at {rows} rows"
        assert torch.equal(layer(x[rows - 1:rows]), batched[rows - 1:rows])
        assert torch.equal(torch.ops.kvforge_cpp.rms_norm(x[:rows], norm_weight, 1e-6), normed[:rows])


# The engine


def signature(output) -> tuple:
    """A request's tokens and every logprob it reported, as exact floats."""
    completion = output.outputs[0]
    return completion.token_ids, [sorted((k, float(getattr(v, "logprob", v))) for k, v in step.items())
                                  for step in completion.logprobs]


def alone(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    results = []
    for prompt, p in zip(PROMPTS, params):
        llm.reset_prefix_cache()
        results.append(signature(llm.generate([prompt], p)[0]))
    llm.reset_prefix_cache()
    return results


def engine(dtype: str, batch_invariant: bool = True, **settings) -> LLM:
    return LLM("kvforge-tiny", dtype=dtype, batch_invariant=batch_invariant, warmup=False,
               cache={"num_blocks": 128}, **settings)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_and_logprobs_are_bitwise_the_same_in_any_batch_chunking_and_cache_state(dtype):
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)] * len(PROMPTS)
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11 + i, logprobs=2)
              for i in range(len(PROMPTS))]
    llm = engine(dtype)
    assert llm.engine.selected[ATTENTION_BACKEND] == "cpp_batch_invariant"
    expected = {}
    for kind, params in (("greedy", greedy), ("seeded", seeded)):
        expected[kind] = alone(llm, params)
        batched = [signature(o) for o in llm.generate(PROMPTS, params)]
        hits = [signature(o) for o in llm.generate(PROMPTS, params)]  # every prompt's full blocks are cached now
        assert batched == expected[kind], f"{kind}: batched differs from one at a time"
        assert hits == expected[kind], f"{kind}: a prefix-cache hit changed a request"
    llm.engine.shutdown()
    chunked = engine(dtype, scheduler={"max_num_batched_tokens": 7})  # every prompt prefilled in chunks of <= 7
    for kind, params in (("greedy", greedy), ("seeded", seeded)):
        assert [signature(o) for o in chunked.generate(PROMPTS, params)] == expected[kind], \
            f"{kind}: chunked prefill changed a request"
    chunked.engine.shutdown()


def test_default_mode_changes_logprob_bits_under_chunked_prefill_here():
    """The engine-level counterpart of the tiles' test: without the mode, chunking a
    prompt changes some logprob's bits on this CPU (the check is vacuous elsewhere)."""
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)] * len(PROMPTS)
    whole = engine("float32", batch_invariant=False)
    if whole.engine.selected[ATTENTION_BACKEND] != "cpp" or torch.ops.kvforge_cpp.isa() != "avx512":
        pytest.skip("the default tiles differ between prefill and decode on the AVX-512 path, not run here")
    unchunked = [signature(o) for o in whole.generate(PROMPTS, greedy)]
    whole.engine.shutdown()
    chunked = engine("float32", batch_invariant=False, scheduler={"max_num_batched_tokens": 7})
    assert [signature(o) for o in chunked.generate(PROMPTS, greedy)] != unchunked
    chunked.engine.shutdown()


# What the mode refuses


def test_a_backend_not_declaring_batch_invariant_is_refused_naming_those_that_do():
    with pytest.raises(SelectionError, match=r"does not declare batch_invariant.*choose one of: cpp_batch_invariant"):
        LLM("kvforge-tiny", batch_invariant=True, attention={"backend": "cpp"}, warmup=False)


@pytest.mark.parametrize("settings, named", [
    ({"linear_kernel": "onednn"}, "linear_kernel 'cpp' or 'auto', not 'onednn'"),
    ({"linear_kernel": "torch"}, "linear_kernel 'cpp' or 'auto', not 'torch'"),
    ({"speculative": {"proposer": "ngram"}}, "speculative.proposer = 'ngram'"),
    ({"quantization": {"weights": "int8_weight"}}, "quantization.weights = 'int8_weight'"),
    ({"lora": {"enabled": True}}, "lora.enabled"),
])
def test_what_the_mode_does_not_cover_is_refused_by_name(settings, named):
    with pytest.raises(UnsupportedConfigurationError, match=f"batch_invariant = true.*{named}"):
        LLM("kvforge-tiny", batch_invariant=True, warmup=False, **settings)


# The command line and the bench


def test_generate_and_serve_flags_set_batch_invariant():
    import argparse

    from kvforge.cli_options import add_batch_invariant_option, batch_invariant_overrides

    parser = argparse.ArgumentParser()
    add_batch_invariant_option(parser)
    assert batch_invariant_overrides(parser.parse_args(["--batch-invariant"])) == ["batch_invariant=true"]
    assert batch_invariant_overrides(parser.parse_args([])) == []


def test_plugins_explain_picks_the_declaring_backend_under_the_mode():
    from kvforge.cli_plugins import report, selection_request
    from kvforge.core import load_config

    config = load_config(overrides=["batch_invariant=true"], device="cpu").config
    registry = build_registry()
    verdict = report(registry, selection_request(config, registry), explain=True)["explain"][ATTENTION_BACKEND]
    usable = {c["name"] for c in verdict["candidates"] if c["usable"]}
    assert "cpp" not in usable and "sdpa" not in usable
    if build_registry().get(ATTENTION_BACKEND, "cpp_batch_invariant").availability().ok:
        assert verdict["chosen"] == "cpp_batch_invariant"


def test_bench_adds_the_subject_with_batch_invariant_and_its_cost_target():
    from kvforge.benchmarks import scenarios
    from kvforge.cli_bench import with_batch_invariant_run

    scenario = scenarios.build("mixed", 512, quick=True)
    with_batch_invariant_run(scenario)
    added = scenario.runs[-1]
    assert (added.label, added.peer, added.options) == ("kvforge batch_invariant", "kvforge", {"batch_invariant": True})
    target = scenario.targets[-1]
    assert (target.subject, target.other, target.metric, target.threshold) == (
        "kvforge batch_invariant", "kvforge", "throughput", 0.87)
    prompts = scenarios.build("long-prompt", 512, quick=True)
    with_batch_invariant_run(prompts)
    assert prompts.runs[-1].options == {"cache": {"enable_prefix_caching": False}, "batch_invariant": True}
