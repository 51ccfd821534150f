"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's log-probability
given the ones before it, as vLLM's `RequestOutput.prompt_logprobs`; the same whether
the prompt runs in one pass, in chunks, or after its blocks were cached, the same as the
logprobs the tokens got when generated, and the same as transformers' log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge import LLM
from kvforge.core import RequestError
from kvforge.engine import prompt_logprobs as scoring
from kvforge.engine.prompt_logprobs import Logprob
from kvforge.engine.sampling_params import SamplingParams
from kvforge.models.loader import resolve_model_dir

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."
TOLERANCE = 1e-4  # float32: the same figures through differently shaped batches


def tiny(**sections) -> LLM:
    return LLM("kvforge-tiny", dtype="float32", seed=0, **sections)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny()


def prompt_logprobs(llm: LLM, prompt, k: int = 0, **params):
    key = "prompt_token_ids" if isinstance(prompt, list) else "prompts"
    (output,) = llm.generate(**{key: [prompt]}, sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=k, **params))
    return output


def own_logprobs(output) -> list[float]:
    """The logprob each prompt token (after the first) got."""
    return [record[token].logprob for token, record in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]


def transformers_logprobs(token_ids: list[int]) -> torch.Tensor:
    """transformers' own log-softmax of kvforge-tiny at every position but the last, float32."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("kvforge-tiny")),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def agrees_with_transformers(output, k: int) -> bool:
    expected = transformers_logprobs(output.prompt_token_ids)
    for position, (token, record) in enumerate(zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])):
        row = expected[position]
        if token not in record or abs(record[token].logprob - float(row[token])) > TOLERANCE:
            return False
        top = row.topk(k)
        for rank, (logprob, top_token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            if top_token not in record or abs(record[top_token].logprob - logprob) > TOLERANCE:
                return False
    return True


def test_one_entry_per_prompt_token_none_first_own_token_first_then_top_k(llm):
    output = prompt_logprobs(llm, PROMPT, k=3)
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    assert output.prompt_logprobs[0] is None
    for token, record in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert next(iter(record)) == token  # its own token first, with its rank
        assert all(isinstance(v, Logprob) for v in record.values())
        tops = sorted((v for t, v in record.items() if t != token or v.rank <= 3), key=lambda v: v.rank)
        assert [v.rank for v in tops][:3] == [1, 2, 3]
        assert len(record) in (3, 4)  # the top 3, and the token itself when not among them
        assert record[token].rank == 1 + sum(v.logprob > record[token].logprob for v in record.values()) or \
            record[token].rank > 3
        assert record[token].decoded_token == llm.tokenizer.decode([token])


def test_prompt_logprobs_zero_holds_the_prompt_token_alone(llm):
    output = prompt_logprobs(llm, PROMPT, k=0)
    assert all(list(record) == [token] for token, record in zip(output.prompt_token_ids[1:],
                                                                output.prompt_logprobs[1:]))


def test_agree_with_transformers_log_softmax_in_float32(llm):
    assert agrees_with_transformers(prompt_logprobs(llm, PROMPT, k=5), k=5)


def test_a_scorer_one_position_off_is_caught(llm, monkeypatch):
    """Planted: token i scored with the logits of position i (which already saw it)
    instead of position i - 1."""
    def off_by_one(request, count):
        first = len(request.prompt_logprobs) - 1
        return request.prompt_token_ids[first:first + count]

    monkeypatch.setattr(scoring, "scored_tokens", off_by_one)
    assert not agrees_with_transformers(prompt_logprobs(llm, PROMPT, k=5), k=5)


def test_teacher_forcing_agrees_with_generation(llm):
    """Generate greedily with logprobs, then score prompt + generated tokens: each
    generated token's prompt logprob is the logprob it got when generated, at rank 1."""
    (generated,) = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True))
    tokens = generated.outputs[0].token_ids
    scored = prompt_logprobs(llm, generated.prompt_token_ids + tokens, k=2)
    start = len(generated.prompt_token_ids)
    for i, token in enumerate(tokens):
        record = scored.prompt_logprobs[start + i]
        assert record[token].rank == 1
        assert math.isclose(record[token].logprob, generated.outputs[0].logprobs[i][token], abs_tol=TOLERANCE)
        for other, logprob in generated.outputs[0].logprobs[i].items():
            assert math.isclose(record[other].logprob, logprob, abs_tol=TOLERANCE)


def test_chunked_prefill_gives_the_one_pass_figures(llm):
    """A 7-token budget splits the prompt into chunks at positions that are no
    multiple of the block size; each chunk boundary's token is scored by the
    previous chunk's last row."""
    whole = prompt_logprobs(llm, PROMPT, k=2)
    chunked = prompt_logprobs(tiny(scheduler={"max_num_batched_tokens": 7}), PROMPT, k=2)
    assert len(chunked.prompt_logprobs) == len(whole.prompt_logprobs)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert list(a) == list(b)
        assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=TOLERANCE) and a[t].rank == b[t].rank for t in a)


def test_cached_prompt_blocks_are_recomputed_for_prompt_logprobs():
    """With the prompt's blocks in the prefix cache, a request with prompt logprobs
    recomputes them (cached tokens have no logits) and gets the figures of a cold
    pass; the blocks it computes are cached for the next request."""
    llm = tiny(cache={"block_size": 4})
    cold = prompt_logprobs(llm, PROMPT, k=1)
    hits = llm.engine.kv.usage().hits
    warm = prompt_logprobs(llm, PROMPT, k=1)
    assert llm.engine.kv.usage().hits == hits
    assert len(warm.prompt_logprobs) == len(cold.prompt_logprobs)
    assert [list(r) for r in warm.prompt_logprobs[1:]] == [list(r) for r in cold.prompt_logprobs[1:]]
    assert own_logprobs(warm) == pytest.approx(own_logprobs(cold), abs=TOLERANCE)
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))  # an ordinary request takes them
    assert llm.engine.kv.usage().hits > hits


def test_requests_without_prompt_logprobs_get_none_and_keep_their_tokens(llm):
    plain, scored = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=6, temperature=0),
                                                    SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1)])
    assert plain.prompt_logprobs is None
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_invalid_prompt_logprobs_are_refused_naming_the_field(bad):
    with pytest.raises(RequestError, match="prompt_logprobs must be None or an integer >= 0"):
        SamplingParams(prompt_logprobs=bad)


def test_preempted_requests_keep_the_prompt_logprobs_of_a_solo_run(llm):
    """A cache too small for three requests preempts them mid-prefill and mid-decode;
    each is recomputed, and none scores a prompt token twice or misses one."""
    prompts = [f"Once upon a time there was a little girl who lived near forest number {i}." for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0, prompt_logprobs=1, ignore_eos=True)
    crowded = tiny(cache={"num_blocks": 16, "block_size": 8}, scheduler={"max_num_batched_tokens": 16})
    outputs = crowded.generate(prompts, params)
    assert crowded.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        (solo,) = llm.generate([prompt], params)
        assert len(output.prompt_logprobs) == len(solo.prompt_logprobs)
        assert own_logprobs(output) == pytest.approx(own_logprobs(solo), abs=TOLERANCE)
        assert output.outputs[0].token_ids == solo.outputs[0].token_ids
