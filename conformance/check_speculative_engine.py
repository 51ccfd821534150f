"""Conformance of every `speculative_proposer`, through the reference engine:
speculation never changes what is generated.

* Greedy output with the proposer is token-for-token the output without it,
  with prefix caching, with chunked prefill, and with preemption forced by a
  small KV cache.
* Sampled output has the same distribution with and without it: a chi-square
  test over many samples of a small vocabulary (top-k 3) cannot tell them
  apart. `tests/test_speculative_statistics.py` shows this test does catch a
  verifier that accepts drafts without comparing.
* A request that runs until its context is full ends where it ends without
  speculation: the engine cuts drafts past the context (the proposer's
  guarantee 4 only asks it not to fail there).
* The engine refuses the proposer's output when it holds ids outside the
  vocabulary, with an error naming the proposer.

The target is the built-in `kvforge-tiny` (a byte-level model), on CPU in
float32. A proposer that cannot serve it (its constructor or `setup` refuses
the target) is skipped with its reason.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.core import SPECULATIVE_PROPOSER, DraftProposal, KvforgeError
from kvforge.engine.drafting import ProposerError
from kvforge.engine.llm import LLM
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams

from .selection import QuickGrid, registry

KIND = SPECULATIVE_PROPOSER
GROUP = "engine"
HEAVY = True  # runs after its kind's light groups: a broken implementation fails those in seconds
TARGET = "kvforge-tiny"
# Text the output tends to repeat, so lookup proposers have something to draft from.
PROMPTS = ["the cat sat on the mat. the cat sat on the", "abcabcabcabcabc", "1 2 3 4 1 2 3 4 1 2",
           "def f(x):\n    return x\ndef g(x):\n    return"]


def engine_for(name: str | None, **settings) -> LLMEngine:
    config = {"model": TARGET, "device": "cpu", "dtype": "float32",
              "cache": {"block_size": 8, "num_blocks": 256, **settings.pop("cache", {})},
              "scheduler": {"max_num_seqs": 256, **settings.pop("scheduler", {})}}
    if name is not None:
        config["speculative"] = {"proposer": name, "num_tokens": 4}
    from kvforge.core import EngineConfig

    return LLMEngine(EngineConfig(**config, **settings), registry=registry())


@pytest.fixture
def proposer_name(registration) -> str:
    try:
        engine_for(registration.name)
    except KvforgeError as exc:
        pytest.skip(f"{registration.name} cannot draft for {TARGET}: {exc}")
    return registration.name


def generate(engine: LLMEngine, prompts, params) -> list[list[int]]:
    outputs = LLM.from_engine(engine).generate(prompts, params)
    assert not any(o.error for o in outputs), [o.error for o in outputs if o.error]
    return [[c.token_ids for c in output.outputs] for output in outputs]


_PREFIX_CACHING = pytest.param({}, id="prefix-caching")
_PREEMPTION = pytest.param({"cache": {"num_blocks": 12}}, id="preemption")  # and recomputation
SETTINGS = QuickGrid(full=[
    _PREFIX_CACHING,
    pytest.param({"cache": {"enable_prefix_caching": False}}, id="no-prefix-caching"),
    pytest.param({"scheduler": {"max_num_batched_tokens": 16}}, id="chunked-prefill"),
    _PREEMPTION,
], quick=[_PREFIX_CACHING, _PREEMPTION])


@pytest.mark.parametrize("settings", SETTINGS)
def test_greedy_output_is_token_for_token_the_same(proposer_name, settings):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def two_waves(engine):  # the second wave's prompts hit the blocks the first one cached
        return generate(engine, PROMPTS, params) + generate(engine, PROMPTS[::-1], params)

    plain = two_waves(engine_for(None, **settings))
    engine = engine_for(proposer_name, **settings)
    assert two_waves(engine) == plain
    figures = engine.metrics()
    assert figures["spec_draft_tokens"] > 0, f"{proposer_name} proposed nothing for repetitive text"
    if settings.get("cache", {}).get("enable_prefix_caching", True):
        assert figures["prefix_cache_hit_rate"] > 0
    if "num_blocks" in settings.get("cache", {}):
        assert figures["preemptions"] > 0


def test_greedy_output_running_into_the_end_of_the_context_is_the_same(proposer_name):
    """Drafts that would pass the context are the engine's to cut (guarantee 4 of the proposer):
    a request that runs until the context is full ends where it ends without speculation."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt = ("the cat sat on the mat. " * 50)[:1000]  # 1000 bytes of a 1024-token context

    def run(engine):
        [output] = LLM.from_engine(engine).generate([prompt], params)
        assert not output.error, output.error
        return output.outputs[0].token_ids, output.outputs[0].finish_reason

    plain = run(engine_for(None))
    engine = engine_for(proposer_name)
    assert run(engine) == plain
    assert plain[1] == "length" and len(plain[0]) < params.max_tokens  # the context, not max_tokens, ended it
    assert engine.metrics()["spec_draft_tokens"] > 0, f"{proposer_name} proposed nothing for repetitive text"


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed `counts` to `probs` (categories of zero probability
    must have zero counts; they are left out)."""
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2), stat / 2))


def homogeneity_pvalue(a: dict, b: dict) -> float:
    """Chi-square test that two samples (`{category: count}`) share one distribution;
    categories rarer than 5 in both are pooled, as the test needs."""
    categories = sorted(set(a) | set(b))
    table = torch.tensor([[a.get(c, 0), b.get(c, 0)] for c in categories], dtype=torch.float64)
    rare = table.sum(1) < 10
    if rare.any():
        table = torch.cat([table[~rare], table[rare].sum(0, keepdim=True)])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2)) if df > 0 else 1.0


def sampled_continuations(engine: LLMEngine, num_samples: int = 240) -> dict:
    """`{(token 1, 2, 3): count}` over `num_samples` top-k 3 samples of one prompt."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, n=num_samples // 4)
    counts: dict = {}
    for sample in generate(engine, [PROMPTS[0]] * 4, params):
        for tokens in sample:
            key = tuple(tokens[1:])  # the first token comes from the prefill, before any draft
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_sampled_output_distribution_is_unchanged(proposer_name):
    plain = sampled_continuations(engine_for(None, seed=1))
    engine = engine_for(proposer_name, seed=2)
    spec = sampled_continuations(engine)
    assert engine.metrics()["spec_draft_tokens"] > 0
    assert homogeneity_pvalue(plain, spec) > 1e-3


def test_out_of_vocabulary_drafts_are_refused_by_name(proposer_name):
    engine = engine_for(proposer_name)
    proposer = engine.drafter.proposer
    honest = proposer.propose
    proposer.propose = lambda requests, k: [DraftProposal([engine.vocab_size]) for _ in honest(requests, k)]
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    with pytest.raises(ProposerError, match=f"proposer {proposer_name!r} proposed token ids \\[{engine.vocab_size}\\]"):
        engine.step()
