"""The `ngram` proposer: the longest suffix n-gram, its most recent earlier
occurrence, the tokens after it; checked against a brute-force lookup."""

from __future__ import annotations

import random

import pytest

from kvforge.core import SPECULATIVE_PROPOSER, ConfigError, ProposalRequest, build_registry
from kvforge.plugins.ngram_proposer import ngram_lookup


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # most recent first, leaving a token after it
            if tokens[end - n + 1: end + 1] == suffix:
                extended = list(tokens)  # an overlapping copy: each draft repeats the token `period` back
                period = len(tokens) - 1 - end
                while len(extended) < len(tokens) + k:
                    extended.append(extended[-period])
                return extended[end + 1: end + 1 + k]
    return []


def proposer(**options):
    return build_registry().select(SPECULATIVE_PROPOSER, "ngram").cls(**options)


def test_a_match_near_the_end_drafts_the_repetition_on():
    # "5 6" last occurred two tokens back: the loop "7 5 6"... has period 3 from there.
    assert ngram_lookup([1, 5, 6, 7, 5, 6], 2, 2, 5) == [7, 5, 6, 7, 5]
    assert ngram_lookup([4, 4, 4], 2, 2, 4) == [4, 4, 4, 4]


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 7, 8, 9, 3, 5, 5, 1, 2, 3]
    # "1 2 3" occurs at the start (then 7 8 9); "3" alone occurs later (then 5).
    assert ngram_lookup(tokens, 1, 4, 3) == [7, 8, 9]


def test_most_recent_occurrence_and_k_cap():
    tokens = [4, 5, 1, 4, 5, 2, 9, 4, 5]
    assert ngram_lookup(tokens, 2, 4, 2) == [2, 9]
    assert ngram_lookup(tokens, 2, 4, 1) == [2]


def test_nothing_below_min_n():
    tokens = [1, 2, 3, 9, 3]
    assert ngram_lookup(tokens, 2, 4, 3) == []
    assert ngram_lookup(tokens, 1, 4, 3) == [9, 3, 9]  # "3" then "9 3" repeating


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force_on_random_sequences(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    assert ngram_lookup(tokens, min_n, max_n, 4) == brute_force(tokens, min_n, max_n, 4)


def test_kept_history_follows_a_growing_sequence_and_an_id_reused_after_release():
    ngram = proposer(min_n=1, max_n=3)
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(3)]
    for _ in range(80):  # grows past the initial buffer
        [draft] = ngram.propose([ProposalRequest("a", list(tokens))], 3)
        assert draft.token_ids == brute_force(tokens, 1, 3, 3) and draft.probs is None
        tokens += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
    ngram.release("a")
    other = [7, 8, 7]
    assert ngram.propose([ProposalRequest("a", other)], 3)[0].token_ids == [8, 7, 8]


@pytest.mark.parametrize("seed", range(10))
def test_kept_history_taking_many_tokens_at_once_drafts_as_a_scan(seed):
    """A request asked again after many steps (adaptive drafting's waits) brings many
    new tokens at once: the index takes them together and drafts as the scan does."""
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    ngram = proposer(min_n=min_n, max_n=max_n)
    tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
    for _ in range(12):
        [draft] = ngram.propose([ProposalRequest("a", list(tokens))], 4)
        assert draft.token_ids == brute_force(tokens, min_n, max_n, 4)
        tokens += [rng.randrange(4) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("options, message", [
    ({"min_n": 0}, "min_n .* must be an integer >= 1"),
    ({"min_n": 3, "max_n": 2}, r"min_n \(3\) .* exceeds max_n \(2\)"),
    ({"window": 3}, r"unknown options \['window'\]"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        proposer(**options)
