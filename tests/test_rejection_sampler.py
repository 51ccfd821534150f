"""Draft verification: greedy rules exactly, and for sampled rows an output
distribution that is the target's (chi-square over many rows on a 4-token
vocabulary), which a verifier accepting without comparing fails."""

from __future__ import annotations

import pytest
import torch

from kvforge import SamplingParams
from kvforge.conformance.check_speculative_engine import chi_square_pvalue
from kvforge.engine.rejection_sampler import RejectionSampler
from kvforge.engine.request import Request
from kvforge.engine.sampler import Sampler

VOCAB = 4
P = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.05, 0.05, 0.4], [0.25, 0.25, 0.25, 0.25]])  # target, positions 0..2
Q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])  # the draft model's, positions 0..1


def request(params: SamplingParams, output=(), eos=None) -> Request:
    r = Request("r", [0, 1], params, eos_token_id=eos)
    r.output_token_ids = list(output)
    return r


def verify(logits_rows, requests, drafts, probs=None, seed=0):
    counts = [len(d) + 1 for d in drafts]
    logits = torch.cat([logits_rows[:c] for c in counts])
    return RejectionSampler(Sampler(seed))(logits, requests, drafts, probs or [None] * len(drafts)).token_ids


def greedy_logits(*argmaxes) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), VOCAB)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_accepts_while_drafts_match_then_emits_the_targets_token():
    rows = greedy_logits(2, 1, 3, 0)
    greedy = SamplingParams(temperature=0)
    assert verify(rows, [request(greedy)], [[2, 0, 3]]) == [[2, 1]]  # second draft wrong: the target's 1
    assert verify(rows, [request(greedy)], [[0, 1, 3]]) == [[2]]
    assert verify(rows, [request(greedy)], [[2, 1, 3]]) == [[2, 1, 3, 0]]  # all accepted, plus a bonus token
    # Rows of different lengths in one batch.
    assert verify(rows, [request(greedy)] * 2, [[2], [2, 1, 0]]) == [[2, 1], [2, 1, 3]]


def test_min_tokens_and_penalties_count_the_earlier_drafts_as_output():
    eos = 3
    rows = torch.tensor([[0.0, 2.0, 0.0, 4.0]] * 3)  # EOS most likely, then 1
    held = request(SamplingParams(temperature=0, min_tokens=2), eos=eos)
    # Positions 0 and 1 have < 2 outputs (EOS masked: 1); position 2 has two (EOS allowed).
    assert verify(rows, [held], [[1, 1]]) == [[1, 1, eos]]
    flat = torch.tensor([[0.0, 1.0, 0.9, 0.0]] * 2)
    penalized = request(SamplingParams(temperature=0, frequency_penalty=2.0))
    assert verify(flat, [penalized], [[1]]) == [[1, 2]]  # the accepted draft 1 is penalized at position 1


def sampled_outputs(mode: str, num_rows: int = 20000, accept_all: bool = False):
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0)
    requests = [request(params) for _ in range(num_rows)]
    drafts = torch.stack([torch.multinomial(Q[j], num_rows, replacement=True) for j in range(2)], 1).tolist()
    probs = [Q] * num_rows
    if mode != "draft-probs":  # a deterministic proposer: always drafts 0 then 3 (q one-hot)
        one_hot = range(num_rows) if mode == "one-hot" else range(0, num_rows, 2)
        for i in one_hot:
            drafts[i], probs[i] = [0, 3], None
    if accept_all:  # the broken verifier: accepts every draft without comparing
        return [d + [int(torch.multinomial(P[2], 1))] for d in drafts[:2000]], drafts
    return verify(P.log(), requests, drafts, probs), drafts


@pytest.mark.parametrize("mode", ["draft-probs", "one-hot", "mixed"])
def test_sampled_output_distribution_is_the_targets(mode):
    emitted, _ = sampled_outputs(mode)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB)
    assert chi_square_pvalue(first, P[0]) > 1e-3
    # Given the first draft was accepted, the second token is the target's at position 1.
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=VOCAB)
    assert second.sum() > 1000 and chi_square_pvalue(second, P[1]) > 1e-3
    lengths = torch.bincount(torch.tensor([len(e) for e in emitted]))
    assert lengths[1] > 0 and lengths[2] > 0 and lengths[3] > 0  # rejections, partial and full acceptance


def test_chi_square_catches_a_verifier_that_accepts_without_comparing():
    emitted, _ = sampled_outputs("draft-probs", accept_all=True)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB)
    assert chi_square_pvalue(first, P[0]) < 1e-6


def test_seeded_rows_draw_from_their_own_stream():
    params = SamplingParams(temperature=1.0, seed=4)
    rows = P.log()
    alone = verify(rows, [request(params)], [[0, 3]], seed=1)
    crowded = verify(rows, [request(SamplingParams(temperature=1.0))] * 3 + [request(params)],
                     [[1], [2, 2], [3], [0, 3]], seed=2)
    assert crowded[-1] == alone[0]


def test_zero_target_probability_is_never_emitted():
    rows = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]] * 3)
    params = SamplingParams(temperature=1.0)
    emitted = verify(rows, [request(params)] * 500, [[2, 2]] * 500)
    assert all(e[0] != 2 and len(e) == 1 for e in emitted)


@pytest.mark.parametrize("seed", range(12))
def test_the_host_path_for_deterministic_drafts_emits_the_batched_paths_tokens(seed):
    """On CPU, deterministic drafts are verified on the host (`_verify_one_hot`):
    for any mix of greedy, sampled, seeded, penalized and filtered rows, with drafts
    of every length, likely or not, it emits exactly the tokens of the batched path,
    which draws the same random numbers."""
    import random

    rng = random.Random(seed)
    vocab = rng.choice([4, 37, 300])
    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, seed=rng.randrange(99)),
             dict(temperature=1.3, top_k=3, top_p=0.9), dict(temperature=0, repetition_penalty=1.4),
             dict(temperature=1.0, min_p=0.2, frequency_penalty=0.5)]
    size = rng.randint(1, 6)
    params = [SamplingParams(max_tokens=50, **rng.choice(kinds)) for _ in range(size)]
    drafts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(size)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    if rng.random() < 0.5:
        logits[:, rng.randrange(vocab)] = float("-inf")
    row = 0
    for draft in drafts:  # make some drafts the likeliest token, so runs of accepts happen
        for j, token in enumerate(draft):
            if rng.random() < 0.6:
                logits[row + j, token] += 6.0
        row += len(draft) + 1

    def run(path: str):
        requests = [Request(f"r{i}", [1, 2], p, eos_token_id=0) for i, p in enumerate(params)]
        sampler = RejectionSampler(Sampler(seed))
        verify = getattr(sampler, path)
        args = (logits.clone(), requests, drafts) + (([None] * size,) if path == "_verify_batched" else ()) + (None,)
        return verify(*args).token_ids

    assert run("_verify_one_hot") == run("_verify_batched")
