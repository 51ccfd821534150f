"""The sampler: each rule checked as a property of the distribution it samples from."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import SamplingParams
from kvforge.engine.request import Request
from kvforge.engine.sampler import Sampler, apply_penalties, row_argmax


def req(i=0, prompt=(1, 2), output=(), eos=None, **params) -> Request:
    r = Request(f"r{i}", list(prompt), SamplingParams(**params), eos_token_id=eos)
    r.output_token_ids = list(output)
    return r


def draws(logits_row: torch.Tensor, count: int, seed: int = 0, **params) -> torch.Tensor:
    requests = [req(i, **params) for i in range(count)]
    return Sampler(seed).sample(logits_row.expand(count, -1), requests).token_ids


def test_greedy_takes_the_argmax():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [req(i, temperature=0) for i in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_never_samples_outside_the_top_k():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    top = set(logits.topk(5).indices.tolist())
    tokens = draws(logits, 3000, top_k=5, temperature=2.0)
    assert set(tokens.tolist()) <= top
    assert len(set(tokens.tolist())) == 5  # and does sample all of them at a high temperature


def test_top_p_keeps_the_smallest_set_reaching_p_renormalized():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = draws(probs.log(), 6000, top_p=0.7)
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0] - 0.5 / 0.8) < 0.03 and abs(counts[1] - 0.3 / 0.8) < 0.03


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = draws(probs.log(), 4000, min_p=0.2)
    assert 3 not in tokens.tolist() and 2 in tokens.tolist()


def test_temperature_sampling_matches_the_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    tokens = draws(logits, 8000, temperature=0.7)
    expected = torch.softmax(logits / 0.7, -1)
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(counts, expected, atol=0.025)


def test_seeded_request_samples_the_same_tokens_whatever_shares_its_batch():
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(vocab, generator=gen) for _ in range(5)]

    def run(batch_size: int, position: int, engine_seed: int) -> list[int]:
        sampler = Sampler(engine_seed)
        seeded = req(0, seed=1234, temperature=1.0)
        others = [req(i + 1, temperature=1.0) for i in range(batch_size - 1)]
        tokens = []
        for row in steps:
            batch = others[:position] + [seeded] + others[position:]
            logits = torch.randn(batch_size, vocab, generator=gen)
            logits[position] = row
            tokens.append(int(sampler.sample(logits, batch).token_ids[position]))
        return tokens

    alone = run(1, 0, engine_seed=0)
    assert run(7, 3, engine_seed=5) == alone
    assert run(3, 2, engine_seed=9) == alone


def test_unseeded_requests_differ_across_engine_seeds():
    logits = torch.zeros(1, 1000)
    assert Sampler(0).sample(logits, [req()]).token_ids.item() != Sampler(1).sample(logits, [req()]).token_ids.item()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    apply_penalties(logits, [req(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


@pytest.mark.parametrize("penalty", [1.4e308, 5e-324])  # inf and 0 in float32
def test_a_repetition_penalty_beyond_float32_neither_bans_nor_forces_a_token(penalty):
    logits = torch.tensor([[2.0, -2.0, 0.0, float("-inf"), 1.0]])
    apply_penalties(logits, [req(prompt=[0, 1, 2, 3], repetition_penalty=penalty)])
    big = torch.finfo(torch.float32).max
    expected = [0.0, -big, 0.0, float("-inf"), 1.0] if penalty > 1 else [big, -0.0, 0.0, float("-inf"), 1.0]
    assert logits.tolist() == [expected]  # finite where it was finite, no NaN, the ban kept


def test_presence_and_frequency_penalties_subtract_per_output_token():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [req(prompt=[3, 3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)])
    # token 1 twice: 0.5 + 2 * 0.25; token 2 once: 0.5 + 0.25; prompt-only token 3 untouched
    assert logits.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    early = req(eos=1, output=[], min_tokens=2, stop_token_ids=[2], temperature=0)
    assert Sampler().sample(logits, [early]).token_ids.item() == 3
    late = req(eos=1, output=[3, 3], min_tokens=2, temperature=0)
    assert Sampler().sample(logits, [late]).token_ids.item() == 1


def test_logprobs_are_the_raw_top_n_and_include_the_sampled_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    out = Sampler().sample(logits, [req(0, logprobs=3, temperature=0), req(1), req(2, logprobs=1)])
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(out.top_logprobs, expected.topk(3).values)
    assert torch.equal(out.top_ids, expected.topk(3).indices)
    assert torch.allclose(out.sampled_logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    assert math.isclose(float(out.top_logprobs[0, 0]), float(out.sampled_logprobs[0]), rel_tol=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (0, 1e-6)])
def test_extreme_top_k_or_top_p_is_greedy(top_k, top_p):
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    tokens = draws(logits[0], 200, top_k=top_k, top_p=top_p)
    assert set(tokens.tolist()) == {int(logits.argmax())}


def naive_keep(logits_row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The definition, one row at a time: top-k, then the smallest nucleus reaching p."""
    order = logits_row.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(logits_row[order], -1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs):
        if kept and mass >= top_p and top_p < 1:  # top_p == 1 keeps all, whatever the rounding
            break
        kept.append(token)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("scale", [0.1, 8.0])  # flat: the nucleus is wide; peaked: it is narrow
def test_top_k_top_p_on_a_large_vocabulary_match_their_definition(scale):
    from kvforge.engine.sampler import apply_top_k_top_p_min_p

    gen = torch.Generator().manual_seed(6)
    settings = [(0, 0.9), (50, 1.0), (300, 0.8), (0, 1.0), (5, 0.3), (1000, 0.95)]
    logits = torch.randn(len(settings), 3000, generator=gen) * scale
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    out = apply_top_k_top_p_min_p(logits.clone(), params)
    for row, (k, p) in enumerate(settings):
        kept = set(torch.nonzero(out[row] > float("-inf")).flatten().tolist())
        assert kept == naive_keep(logits[row], k, p), (k, p)
        assert torch.equal(out[row][list(kept)], logits[row][list(kept)])



@pytest.mark.parametrize("vocab", [40, 3000])  # a full sort; the first 256 candidates, then a full sort
@pytest.mark.parametrize("scale", [0.1, 8.0])
def test_a_rows_truncation_is_the_same_alone_and_in_any_batch(vocab, scale):
    # A batch leaves out the passes it does not need (no row with top-k, every row truncated): a row
    # alone must come out bitwise as it does beside rows that need them.
    from kvforge.engine.sampler import apply_top_k_top_p_min_p

    gen = torch.Generator().manual_seed(11)
    settings = [(0, 0.9), (0, 0.5), (20, 1.0), (7, 0.6), (0, 1.0)]
    logits = torch.randn(len(settings), vocab, generator=gen) * scale
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    together = apply_top_k_top_p_min_p(logits.clone(), params)
    for row, param in enumerate(params):
        alone = apply_top_k_top_p_min_p(logits[row:row + 1].clone(), [param])
        assert torch.equal(alone[0], together[row]), settings[row]
        for other in range(len(params)):  # and beside each other kind of row
            pair = apply_top_k_top_p_min_p(logits[[row, other]].clone(), [param, params[other]])
            assert torch.equal(pair[0], together[row]), (settings[row], settings[other])

def test_sampling_leaves_the_callers_logits_unchanged():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    requests = [req(0), req(1, temperature=0), req(2, output=(1,), eos=5, min_tokens=3),
                req(3, output=(4, 4), presence_penalty=0.5)]
    Sampler().sample(logits, requests)
    assert torch.equal(logits, before)
    # Without min_tokens or penalties the logits are not copied: truncation must not write them.
    Sampler().sample(logits, [req(0, top_k=3), req(1, top_p=0.5), req(2, min_p=0.1, temperature=0.5), req(3)])
    assert torch.equal(logits, before)


def test_a_sampler_gives_the_same_tokens_after_larger_and_smaller_batches():
    # The CDF buffer a sampler keeps between steps must not leak one batch into the next.
    gen = torch.Generator().manual_seed(4)
    small, large = torch.randn(3, 64, generator=gen), torch.randn(9, 64, generator=gen)
    fresh = Sampler(7).sample(small, [req(i, seed=i) for i in range(3)]).token_ids
    used = Sampler(7)
    used.sample(large, [req(i, seed=i) for i in range(9)])
    used.sample(small[:1], [req(0, seed=0)])
    assert torch.equal(used.sample(small, [req(i, seed=i) for i in range(3)]).token_ids, fresh)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 4), width=st.integers(1, 1100), block=st.sampled_from([4, 16, 256]),
       seed=st.integers(0, 2**31 - 1), specials=st.lists(st.sampled_from(["inf", "-inf", "nan"]), max_size=3))
def test_row_argmax_is_torch_argmax_with_ties_infinities_and_nan(rows, width, block, seed, specials):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, width), generator=generator).float()  # few values: many ties
    for i, special in enumerate(specials):
        if rows:
            x[i % rows, torch.randint(0, width, (1,), generator=generator)] = float(special)
    if rows > 1:
        x[-1] = float("-inf")  # a row with nothing but -inf
    assert torch.equal(row_argmax(x, block, direct_below=0), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x, block), x.argmax(dim=-1))
