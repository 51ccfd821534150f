"""The proposer conformance checks can fail: a simple correct proposer passes
every one, and each planted variant (tests/planted/speculative_proposers.py) is
caught by the check written for the guarantee it breaks; a proposer that cannot
serve the target is skipped with its reason."""

from __future__ import annotations

import json

import pytest

from kvforge.conformance import check_speculative_proposer as check
from kvforge.core import SPECULATIVE_PROPOSER, ConfigError, Registry, hookimpl
from tests.planted.speculative_proposers import (
    DraftOutsideItsProbs,
    FailsPastTheContext,
    ForgetsNothingOnRelease,
    OutOfVocabulary,
    RepeatLast,
    SkipsEmptyDrafts,
    SortedById,
    TensorIds,
    TooMany,
    TransposedProbs,
    UnnormalizedProbs,
    Unseeded,
    VOCAB,
)


class RefusesTheTarget(RepeatLast):
    name = "refuses-target"

    def setup(self, target):
        raise ConfigError(f"this proposer drafts for llama-70b only, not {target.model!r}")


class NeedsAnOption(RepeatLast):
    name = "needs-option"

    def __init__(self, window=None):
        if window is None:
            raise ConfigError("needs-option requires speculative.options.window")
        self.window = window


BROKEN = [OutOfVocabulary, TooMany, TensorIds, SkipsEmptyDrafts, SortedById, Unseeded, UnnormalizedProbs,
          DraftOutsideItsProbs, TransposedProbs, ForgetsNothingOnRelease, FailsPastTheContext, RefusesTheTarget,
          NeedsAnOption]


class _Plugin:
    @hookimpl
    def kvforge_implementations(self):
        return [RepeatLast, *BROKEN]


@pytest.fixture(scope="module")
def registry():
    registry = Registry(strict=True)
    registry.register_plugin(_Plugin(), "proposer-mutants")
    return registry


def registration(registry, cls):
    return registry.get(SPECULATIVE_PROPOSER, cls.name)


def run_all_checks(registration) -> None:
    for seed in check.SEEDS:
        for k in check.NUM_TOKENS:
            check.test_one_proposal_per_request_of_at_most_k_tokens_inside_the_vocabulary(registration, seed, k)
        check.test_proposals_follow_the_order_of_the_requests(registration, seed)
        check.test_same_state_and_inputs_give_the_same_proposals(registration, seed)
        check.test_probs_are_probability_rows_with_mass_on_each_draft(registration, seed)
    check.test_requests_at_the_end_of_the_context_are_served(registration)
    check.test_release_of_an_unknown_request_is_harmless(registration)


def test_a_correct_proposer_passes_every_check(registry):
    run_all_checks(registration(registry, RepeatLast))


def test_the_requests_cover_what_the_checks_need():
    requests = check.make_requests(0)
    assert min(len(r.token_ids) for r in requests) == 1  # the shortest possible request
    assert {r.temperature == 0 for r in requests} == {True, False}  # greedy and sampled
    assert all(0 <= t < VOCAB for r in requests for t in r.token_ids)


@pytest.mark.parametrize("cls, message", [
    (OutOfVocabulary, r"draft tokens \[262, .*\] are not ids in \[0, 259\)"),
    (TensorIds, r"are not ids"),
    (TooMany, r"5 drafts, more than k = 4"),
    (SkipsEmptyDrafts, r"4 proposals for 5 requests"),
], ids=lambda v: getattr(v, "name", ""))
def test_invalid_proposals_are_caught(registry, cls, message):
    with pytest.raises(AssertionError, match=message):
        check.test_one_proposal_per_request_of_at_most_k_tokens_inside_the_vocabulary(registration(registry, cls), 0, 4)


def test_proposals_out_of_request_order_are_caught(registry):
    with pytest.raises(AssertionError, match="reverse order"):
        check.test_proposals_follow_the_order_of_the_requests(registration(registry, SortedById), 0)


def test_nondeterministic_proposals_are_caught(registry):
    with pytest.raises(AssertionError, match="the same proposer asked twice: the drafts differ"):
        check.test_same_state_and_inputs_give_the_same_proposals(registration(registry, Unseeded), 0)


@pytest.mark.parametrize("cls, message", [
    (UnnormalizedProbs, "rows sum to"),
    (DraftOutsideItsProbs, "must have non-zero mass"),
    (TransposedProbs, r"shape \(259, 4\), not \[len\(token_ids\), vocab\]"),
], ids=lambda v: getattr(v, "name", ""))
def test_bad_probs_are_caught(registry, cls, message):
    with pytest.raises(AssertionError, match=message):
        check.test_probs_are_probability_rows_with_mass_on_each_draft(registration(registry, cls), 0)


def test_the_context_end_requests_pass_the_context_beside_a_short_one():
    requests = check.context_end_requests()
    assert all(len(r.token_ids) + 4 > check.TARGET.max_model_len for r in requests[:-1])
    assert all(len(r.token_ids) < check.TARGET.max_model_len for r in requests)  # the engine asks no full request
    assert len(requests[-1].token_ids) + 4 <= check.TARGET.max_model_len


def test_a_proposer_that_fails_past_the_context_is_caught_naming_guarantee_4(registry):
    with pytest.raises(AssertionError, match=r"^guarantee 4: propose raised IndexError: .* for requests of up to 1023 "
                                             r"tokens with num_tokens=4 and a context of 1024"):
        check.test_requests_at_the_end_of_the_context_are_served(registration(registry, FailsPastTheContext))


def test_release_of_an_unknown_id_that_raises_is_caught(registry):
    with pytest.raises(KeyError):
        check.test_release_of_an_unknown_request_is_harmless(registration(registry, ForgetsNothingOnRelease))


def test_a_proposer_that_refuses_the_target_is_skipped_with_its_reason(registry):
    with pytest.raises(pytest.skip.Exception, match="refuses-target cannot draft for .*'kvforge-tiny': .*llama-70b"):
        check.test_release_of_an_unknown_request_is_harmless(registration(registry, RefusesTheTarget))


def test_options_from_the_environment_reach_the_proposer(registry, monkeypatch):
    needs = registration(registry, NeedsAnOption)
    with pytest.raises(pytest.skip.Exception, match=f"requires speculative.options.window .*{check.OPTIONS_ENV}"):
        check.test_release_of_an_unknown_request_is_harmless(needs)
    monkeypatch.setenv(check.OPTIONS_ENV, json.dumps({"needs-option": {"window": 3}}))
    run_all_checks(needs)


@pytest.mark.parametrize("cls", BROKEN, ids=lambda c: c.name)
def test_every_broken_proposer_fails_or_is_skipped_by_the_group_as_a_whole(registry, cls):
    with pytest.raises((AssertionError, KeyError, pytest.skip.Exception)):
        run_all_checks(registration(registry, cls))


def test_the_quick_grid_is_a_subset_of_the_full_one(monkeypatch):
    from kvforge.conformance.selection import QUICK_ENV

    monkeypatch.delenv(QUICK_ENV, raising=False)
    full = (list(check.SEEDS), list(check.NUM_TOKENS))
    monkeypatch.setenv(QUICK_ENV, "1")
    quick = (list(check.SEEDS), list(check.NUM_TOKENS))
    assert all(set(q) < set(f) for q, f in zip(quick, full)) and all(quick)
