"""Conformance of every `speculative_proposer`: the guarantees in
`kvforge.core.speculative.SpeculativeProposer`'s docstring, checked at the
interface (what the engine does with the drafts is checked by the engine's tests).

Each proposer drafts for the built-in `kvforge-tiny` target (`TARGET`): a
proposer that runs a model of its own needs a real target to draft for, and
kvforge-tiny is the one every installation has. A proposer is built with no
options, or with those `OPTIONS_ENV` names for it; one whose constructor or
`setup` refuses that (a `KvforgeError`) is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kvforge.core import (
    SPECULATIVE_PROPOSER,
    DraftProposal,
    KvforgeError,
    ProposalRequest,
    ProposerTarget,
    Registration,
    SpeculativeProposer,
)

from .selection import QuickGrid

KIND = SPECULATIVE_PROPOSER
GROUP = "proposals"

OPTIONS_ENV = "KVFORGE_CONFORMANCE_PROPOSER_OPTIONS"
"""JSON `{"proposer name": {option: value}}`: options for proposers that need some."""

TARGET = ProposerTarget(model="kvforge-tiny", vocab_size=259, max_model_len=1024, device=torch.device("cpu"),
                        dtype=torch.float32)
"""kvforge-tiny's facts as its config.json states them (a test keeps the two in step)."""

NUM_TOKENS = QuickGrid(full=(1, 4), quick=(4,))
SEEDS = QuickGrid(full=range(2), quick=range(1))


def options_for(name: str) -> dict:
    configured = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
    return dict(configured.get(name, {}))


def ready(registration: Registration) -> SpeculativeProposer:
    """A fresh instance, set up for `TARGET`; skips, with the reason, a proposer that refuses it."""
    try:
        proposer = registration.cls(**options_for(registration.name))
        proposer.setup(TARGET)
    except KvforgeError as exc:
        pytest.skip(f"{registration.name} cannot draft for the conformance target {TARGET.model!r}: {exc} "
                    f"(give it options with {OPTIONS_ENV})")
    return proposer


def make_requests(seed: int) -> list[ProposalRequest]:
    """Requests of varied lengths (one token to a few dozen), some text repeating
    itself (so lookup proposers find something), greedy and sampled."""
    rng = random.Random(seed)
    requests = []
    for i, (length, temperature) in enumerate([(1, 0.0), (9, 0.0), (40, 0.7), (23, 0.0), (17, 1.3)]):
        phrase = [rng.randrange(32, 127) for _ in range(rng.randint(2, 6))]
        tokens = (phrase * length)[:length] if i % 2 else [rng.randrange(256) for _ in range(length)]
        requests.append(ProposalRequest(f"s{seed}-r{i}", tokens, temperature))
    return requests


def token_ids(proposals: list[DraftProposal]) -> list[list[int]]:
    return [list(p.token_ids) for p in proposals]


def assert_same(first: list[DraftProposal], second: list[DraftProposal], what: str) -> None:
    assert token_ids(first) == token_ids(second), f"{what}: the drafts differ"
    for i, (a, b) in enumerate(zip(first, second)):
        assert (a.probs is None) == (b.probs is None), f"{what}: request {i} has probs only once"
        if a.probs is not None:
            assert torch.allclose(a.probs.float(), b.probs.float(), atol=1e-5), f"{what}: request {i}'s probs differ"


def assert_valid(requests: list[ProposalRequest], proposals, num_tokens: int) -> None:
    """Guarantee 1: one DraftProposal per request, in order, each of at most `num_tokens` ids in the vocabulary."""
    assert isinstance(proposals, list), f"propose returned {type(proposals).__name__}, not a list"
    assert len(proposals) == len(requests), f"{len(proposals)} proposals for {len(requests)} requests"
    for request, proposal in zip(requests, proposals):
        assert isinstance(proposal, DraftProposal), f"a proposal is a {type(proposal).__name__}, not a DraftProposal"
        drafts = list(proposal.token_ids)
        assert len(drafts) <= num_tokens, f"{request.request_id}: {len(drafts)} drafts, more than k = {num_tokens}"
        bad = [t for t in drafts if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < TARGET.vocab_size]
        assert not bad, f"{request.request_id}: draft tokens {bad} are not ids in [0, {TARGET.vocab_size})"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_one_proposal_per_request_of_at_most_k_tokens_inside_the_vocabulary(registration, seed, num_tokens):
    proposer = ready(registration)
    requests = make_requests(seed)
    assert_valid(requests, proposer.propose(requests, num_tokens), num_tokens)
    assert proposer.propose([], num_tokens) == []


def context_end_requests() -> list[ProposalRequest]:
    """Requests one, two and three tokens short of the context, whose drafts pass it at
    k = 4, with a short one beside them, as the engine asks: one call, k the most any
    request of it may take. Their text repeats, so lookup proposers find drafts."""
    phrase = [ord(c) for c in "the end of the context. "]
    lengths = [TARGET.max_model_len - short for short in (1, 2, 3)]
    requests = [ProposalRequest(f"end-{n}", (phrase * (n // len(phrase) + 1))[:n], 0.0) for n in lengths]
    return requests + [ProposalRequest("short", phrase[:5], 0.7)]


def test_requests_at_the_end_of_the_context_are_served(registration):
    proposer = ready(registration)
    requests, num_tokens = context_end_requests(), 4
    try:
        proposals = proposer.propose(requests, num_tokens)
    except Exception as exc:
        longest = max(len(r.token_ids) for r in requests)
        raise AssertionError(
            f"guarantee 4: propose raised {type(exc).__name__}: {exc} for requests of up to {longest} tokens with "
            f"num_tokens={num_tokens} and a context of {TARGET.max_model_len}; serve them (drafting fewer, or as "
            "many: the engine cuts drafts past the context)") from exc
    assert_valid(requests, proposals, num_tokens)


@pytest.mark.parametrize("seed", SEEDS)
def test_proposals_follow_the_order_of_the_requests(registration, seed):
    requests = make_requests(seed)
    forward = ready(registration).propose(requests, 4)
    backward = ready(registration).propose(requests[::-1], 4)
    assert_same(forward, backward[::-1], "proposing for the requests in reverse order, then reversing")


@pytest.mark.parametrize("seed", SEEDS)
def test_same_state_and_inputs_give_the_same_proposals(registration, seed):
    requests = make_requests(seed)
    proposer = ready(registration)
    first = proposer.propose(requests, 4)
    assert_same(first, proposer.propose(requests, 4), "the same proposer asked twice")
    assert_same(first, ready(registration).propose(requests, 4), "a fresh instance")


@pytest.mark.parametrize("seed", SEEDS)
def test_probs_are_probability_rows_with_mass_on_each_draft(registration, seed):
    for proposal in ready(registration).propose(make_requests(seed), 4):
        if proposal.probs is None:
            continue
        probs, drafts = proposal.probs, list(proposal.token_ids)
        assert isinstance(probs, torch.Tensor), f"probs is a {type(probs).__name__}, not a tensor"
        assert tuple(probs.shape) == (len(drafts), TARGET.vocab_size), \
            f"probs has shape {tuple(probs.shape)}, not [len(token_ids), vocab] = [{len(drafts)}, {TARGET.vocab_size}]"
        probs = probs.double()
        assert torch.isfinite(probs).all() and (probs >= 0).all(), "probs has negative or non-finite entries"
        sums = probs.sum(dim=-1)
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-3), f"probs rows sum to {sums.tolist()}, not 1"
        mass = probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.int64)]
        assert (mass > 0).all(), f"drafts {drafts} have probabilities {mass.tolist()}: a draft must have non-zero mass"


def test_release_of_an_unknown_request_is_harmless(registration):
    requests = make_requests(0)
    proposer = ready(registration)
    proposer.release("never-proposed-for")
    first = proposer.propose(requests, 4)
    proposer.release("never-proposed-for")
    for request in requests:
        proposer.release(request.request_id)
        proposer.release(request.request_id)  # twice: the second time it is unknown
    assert_same(first, proposer.propose(requests, 4), "proposing again after release")
