"""The proposer conformance checks fail proposers that break the contract."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvforge.conformance import check_speculative_proposer as check
from kvforge.core import DraftProposal, SpeculativeProposer


class OutOfVocabulary(SpeculativeProposer):
    name = "oov"

    def propose(self, requests, num_tokens):
        return [DraftProposal([259]) for _ in requests]


class ZeroMassDraft(SpeculativeProposer):
    name = "zero-mass"

    def propose(self, requests, num_tokens):
        probs = torch.zeros(1, 259)
        probs[0, 1] = 1.0
        return [DraftProposal([0], probs) for _ in requests]  # draft 0 has no mass in its own row


class Drifting(SpeculativeProposer):
    name = "drifting"
    made = 0

    def __init__(self):
        Drifting.made += 1
        self.offset = Drifting.made

    def propose(self, requests, num_tokens):
        return [DraftProposal([self.offset % 259]) for _ in requests]


@pytest.mark.parametrize("cls, check_name", [
    (OutOfVocabulary, "test_proposals_are_valid_and_probabilities_are_distributions"),
    (ZeroMassDraft, "test_proposals_are_valid_and_probabilities_are_distributions"),
    (Drifting, "test_same_calls_give_the_same_proposals"),
])
def test_contract_checks_catch_a_broken_proposer(cls, check_name):
    with pytest.raises(AssertionError):
        getattr(check, check_name)(SimpleNamespace(cls=cls, name=cls.name), 0.0)
