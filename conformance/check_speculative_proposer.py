"""Conformance of every `speculative_proposer` on its own: the guarantees in
`kvforge.core.speculative.SpeculativeProposer`'s docstring.

1. One proposal per request, in order, each with at most `num_tokens` tokens,
   all inside the vocabulary.
2. `probs`, when given, are `[len(token_ids), vocab]` rows of probabilities
   (non-negative, summing to 1) in which the draft token has non-zero mass.
3. Proposals are a pure function of the inputs and the state: two fresh
   proposers given the same calls propose the same.

The target facts are those of the built-in `kvforge-tiny`; a proposer that
cannot serve it (its constructor or `setup` refuses) is skipped with its reason.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvforge.core import SPECULATIVE_PROPOSER, KvforgeError, ProposalRequest, ProposerTarget

KIND = SPECULATIVE_PROPOSER
GROUP = "proposals"
TARGET = ProposerTarget("kvforge-tiny", vocab_size=259, max_model_len=1024, device=torch.device("cpu"),
                        dtype=torch.float32)


def fresh(registration):
    try:
        proposer = registration.cls()
        proposer.setup(TARGET)
    except KvforgeError as exc:
        pytest.skip(f"{registration.name} cannot draft for {TARGET.model}: {exc}")
    return proposer


def calls(seed: int, temperature: float) -> list[tuple[list[ProposalRequest], int]]:
    """A few steps of a growing batch: repetitive and random token sequences."""
    rng = random.Random(seed)
    sequences = {f"r{i}": ([rng.randrange(256) for _ in range(5)] * 4 if i % 2 else
                           [rng.randrange(256) for _ in range(rng.randint(1, 30))]) for i in range(4)}
    steps = []
    for k in (1, 3, 4):
        steps.append(([ProposalRequest(rid, list(tokens), temperature) for rid, tokens in sequences.items()], k))
        for tokens in sequences.values():
            tokens += [rng.randrange(256) for _ in range(rng.randint(1, 3))]
    return steps


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_proposals_are_valid_and_probabilities_are_distributions(registration, temperature):
    proposer = fresh(registration)
    for requests, k in calls(0, temperature):
        proposals = proposer.propose(requests, k)
        assert isinstance(proposals, list) and len(proposals) == len(requests)
        for proposal in proposals:
            tokens = proposal.token_ids
            assert len(tokens) <= k and all(isinstance(t, int) and 0 <= t < TARGET.vocab_size for t in tokens)
            if proposal.probs is not None:
                probs = proposal.probs.float().cpu()
                assert probs.shape == (len(tokens), TARGET.vocab_size)
                assert bool((probs >= 0).all()) and torch.allclose(probs.sum(-1), torch.ones(len(tokens)), atol=1e-3)
                assert bool((probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] > 0).all())


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_same_calls_give_the_same_proposals(registration, temperature):
    first, second = fresh(registration), fresh(registration)
    for requests, k in calls(1, temperature):
        a, b = first.propose(requests, k), second.propose(requests, k)
        assert [p.token_ids for p in a] == [p.token_ids for p in b]


def test_released_request_ids_can_be_reused(registration):
    proposer = fresh(registration)
    requests, k = calls(2, 0.0)[0]
    proposer.propose(requests, k)
    for request in requests:
        proposer.release(request.request_id)
    again = fresh(registration)
    other = [ProposalRequest(r.request_id, list(reversed(r.token_ids))) for r in requests]
    assert [p.token_ids for p in proposer.propose(other, k)] == [p.token_ids for p in again.propose(other, k)]
