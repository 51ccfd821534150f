"""Planted speculative proposers: `RepeatLast`, a simple correct proposer, and
mutants of it with one bug each, the bug in its docstring."""

from __future__ import annotations

import random

import torch

from kvforge.conformance.check_speculative_proposer import TARGET
from kvforge.core import DraftProposal, SpeculativeProposer

VOCAB = TARGET.vocab_size


class RepeatLast(SpeculativeProposer):
    """Drafts the request's last token k times; sampled requests get rows that put
    half the mass on it and spread the rest evenly."""

    name = "repeat-last"

    def propose(self, requests, num_tokens):
        return [self.draft(request, num_tokens) for request in requests]

    def draft(self, request, num_tokens):
        drafts = [request.token_ids[-1]] * num_tokens
        if request.temperature == 0:
            return DraftProposal(drafts)
        probs = torch.full((num_tokens, VOCAB), 0.5 / VOCAB)
        probs[torch.arange(num_tokens), drafts] += 0.5
        return DraftProposal(drafts, probs)


class OutOfVocabulary(RepeatLast):
    """Proposes ids past the end of the target's vocabulary."""

    name = "out-of-vocabulary"

    def draft(self, request, num_tokens):
        return DraftProposal([VOCAB + 3] * num_tokens)


class TooMany(RepeatLast):
    """Ignores the number of tokens asked for: one draft more than k."""

    name = "too-many"

    def draft(self, request, num_tokens):
        return DraftProposal([request.token_ids[-1]] * (num_tokens + 1))


class TensorIds(RepeatLast):
    """Returns a tensor of ids where the interface asks for a list of ints."""

    name = "tensor-ids"

    def draft(self, request, num_tokens):
        return DraftProposal(torch.tensor([request.token_ids[-1]] * num_tokens))


class SkipsEmptyDrafts(RepeatLast):
    """Leaves out the proposals of one-token requests, shifting every later one."""

    name = "skips-empty"

    def propose(self, requests, num_tokens):
        return [self.draft(r, num_tokens) for r in requests if len(r.token_ids) > 1]


class SortedById(RepeatLast):
    """Answers in request-id order, not in the order the requests came."""

    name = "sorted-by-id"

    def propose(self, requests, num_tokens):
        return [self.draft(r, num_tokens) for r in sorted(requests, key=lambda r: r.request_id)]


class Unseeded(RepeatLast):
    """Drafts from an unseeded random stream, so the same state drafts differently."""

    name = "unseeded"

    def draft(self, request, num_tokens):
        return DraftProposal([random.randrange(VOCAB) for _ in range(num_tokens)])


class UnnormalizedProbs(RepeatLast):
    """Returns exp(logits) without dividing by their sum."""

    name = "unnormalized-probs"

    def draft(self, request, num_tokens):
        proposal = super().draft(request, num_tokens)
        if proposal.probs is not None:
            proposal.probs = proposal.probs * 3
        return proposal


class DraftOutsideItsProbs(RepeatLast):
    """Samples its rows but reports a token the rows give no mass."""

    name = "draft-outside-probs"

    def draft(self, request, num_tokens):
        proposal = super().draft(request, num_tokens)
        if proposal.probs is not None:
            proposal.probs = torch.zeros_like(proposal.probs)
            proposal.probs[:, (request.token_ids[-1] + 1) % VOCAB] = 1.0
        return proposal


class TransposedProbs(RepeatLast):
    """Returns `[vocab, k]` instead of `[k, vocab]`."""

    name = "transposed-probs"

    def draft(self, request, num_tokens):
        proposal = super().draft(request, num_tokens)
        if proposal.probs is not None:
            proposal.probs = proposal.probs.T
        return proposal


class ForgetsNothingOnRelease(RepeatLast):
    """Keeps a table of requests and fails on ids it never saw."""

    name = "strict-release"

    def __init__(self, **options):
        super().__init__(**options)
        self.seen: set[str] = set()

    def propose(self, requests, num_tokens):
        self.seen.update(r.request_id for r in requests)
        return super().propose(requests, num_tokens)

    def release(self, request_id):
        self.seen.remove(request_id)


class FailsPastTheContext(RepeatLast):
    """Looks its drafts' positions up in a table as long as the target's context, and
    raises IndexError for a request whose drafts would pass it (guarantee 4: the engine
    cuts such drafts itself, so a proposer must serve the request, not fail)."""

    name = "fails-past-the-context"

    def setup(self, target):
        self.positions = torch.arange(target.max_model_len)

    def draft(self, request, num_tokens):
        length = len(request.token_ids)
        self.positions[length + num_tokens - 1].item()  # IndexError past the context
        return super().draft(request, num_tokens)


PLANTED = [
    OutOfVocabulary, TooMany, TensorIds, SkipsEmptyDrafts, SortedById, Unseeded, UnnormalizedProbs,
    DraftOutsideItsProbs, TransposedProbs, ForgetsNothingOnRelease, FailsPastTheContext,
]
