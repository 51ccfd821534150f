"""The `ngram` speculative proposer: prompt lookup.

The longest suffix n-gram of a request's tokens (n from `max_n` down to
`min_n`) is looked up earlier in the same tokens (prompt and output); at its
most recent occurrence, the tokens that followed it are the draft, continued as
a repetition when they run into the end of the tokens. It costs no
model, and pays off wherever the output repeats its input: code edits, quoted
text, summaries, retrieval answers.

Each request keeps, for every n, the most recent position of each n-gram of its
tokens that has a token after it; a step adds the new tokens to that index (all
of a request's new tokens at once, however many steps it was not asked) and
reads it `max_n - min_n + 1` times, so proposing costs microseconds per request
whatever its length (`ngram_lookup` is the same lookup as one scan of the tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.core import ConfigError, DraftProposal, ProposalRequest, SpeculativeProposer, cdiv, hookimpl


SYNC_BATCHED = 8  # new tokens from which a history takes them in per-n batches


class _History:
    """One request's tokens, and for each n the most recent end of every n-gram that
    has a token after it: the suffix lookup is then `max_n - min_n + 1` dict reads,
    and each new token adds as many entries (O(1) per token and step, where a scan
    of the tokens costs O(length) per step)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def sync(self, token_ids: Sequence[int]) -> None:
        """Take in the tokens of `token_ids` not seen yet."""
        known = len(self.tokens)
        if len(token_ids) < known or (known and token_ids[known - 1] != self.tokens[known - 1]):
            self.__init__(self.min_n, self.max_n)  # not the sequence we followed (an id reused): start over
            known = 0
        tokens = self.tokens
        tokens.extend(token_ids[known:])
        # The n-grams ending at known - 1 .. len - 2 now have a token after them, set in
        # order so the most recent end wins. A few (a request asked every step) one by
        # one; many (one asked again after a wait) in one `update` per n, zip building
        # the tuples, which costs less from about SYNC_BATCHED tokens on.
        last = len(tokens) - 1
        if last - known < SYNC_BATCHED:
            for end in range(max(known - 1, 0), last):
                for n, ends in self.ends.items():
                    if end >= n - 1:
                        ends[tuple(tokens[end - n + 1: end + 1])] = end
            return
        for n, ends in self.ends.items():
            first = max(known - 1, n - 1)
            grams = zip(*(tokens[first - n + 1 + i: last - n + 1 + i] for i in range(n)))
            ends.update(zip(grams, range(first, last)))

    def lookup(self, k: int) -> list[int]:
        """`ngram_lookup(tokens, min_n, max_n, k)`, from the index."""
        tokens = self.tokens
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if n < len(tokens):
                end = self.ends[n].get(tuple(tokens[len(tokens) - n:]))
                if end is not None:
                    follow = tokens[end + 1:]
                    return (follow * cdiv(k, len(follow)))[:k]
        return []


def ngram_lookup(tokens: np.ndarray | Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram of `tokens` (`min_n <= n <= max_n`), read as an
    overlapping copy (`tokens + draft` repeats with the distance from that
    occurrence to the end); [] when none occurs."""
    tokens = np.asarray(tokens, dtype=np.int64)
    length = tokens.size
    ends = length - 1  # candidate n-gram ends 0 .. length - 2 leave a token after them
    if ends < min_n or k <= 0:
        return []
    # matched[e]: how many tokens ending at e equal the suffix, counted backwards up to max_n.
    matched = np.zeros(ends, dtype=np.int32)
    run = np.ones(ends, dtype=bool)
    for back in range(min(max_n, ends)):  # a loop over n, not over tokens
        same = np.zeros(ends, dtype=bool)
        same[back:] = tokens[: ends - back] == tokens[length - 1 - back]
        run &= same
        if not run.any():
            break
        matched += run
    best = int(matched.max())
    if best < min_n:
        return []
    # The most recent of the longest matches: its continuation is the freshest guess.
    end = ends - 1 - int(np.argmax(matched[::-1] == best))
    # What followed it runs up to the end of the tokens, `period` of them; past that the
    # guess is that the repetition goes on, so the copy overlaps itself (a loop of period
    # 2 drafts k tokens, not 2).
    period = length - 1 - end
    return np.tile(tokens[end + 1:], cdiv(k, period))[:k].tolist()


class NgramProposer(SpeculativeProposer):
    """Prompt-lookup drafts. Options (`speculative.options`):

    * `min_n` (default 2): the shortest n-gram worth matching. A single shared
      token is mostly coincidence on natural text ("the", ","), so n = 1 drafts
      are rejected often and cost verification work for little gain.
    * `max_n` (default 4): the longest n-gram tried; longer matches are more
      reliable but rarer, and the lookup costs `max_n` compares per token.
    """

    name = "ngram"
    cheap = True  # a lookup, no model: adaptive drafting may ask it every step
    priority = 10  # `auto`'s choice: it serves any target, where draft_model needs a draft of the same vocabulary

    def __init__(self, *, min_n: int = 2, max_n: int = 4, **unknown):
        if unknown:
            raise ConfigError(f"speculative proposer 'ngram' got unknown options {sorted(unknown)}; "
                              "its options are min_n and max_n")
        for option, value in (("min_n", min_n), ("max_n", max_n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative.options.{option} of proposer 'ngram' must be an integer >= 1, "
                                  f"got {value!r}")
        if min_n > max_n:
            raise ConfigError(f"speculative.options.min_n ({min_n}) of proposer 'ngram' exceeds max_n ({max_n}); "
                              "set min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.histories: dict[str, _History] = {}

    def propose(self, requests: Sequence[ProposalRequest], num_tokens: int) -> list[DraftProposal]:
        proposals = []
        for request in requests:
            history = self.histories.get(request.request_id)
            if history is None:
                history = self.histories[request.request_id] = _History(self.min_n, self.max_n)
            history.sync(request.token_ids)
            proposals.append(DraftProposal(history.lookup(num_tokens)))
        return proposals

    def release(self, request_id: str) -> None:
        self.histories.pop(request_id, None)


@hookimpl
def kvforge_implementations():
    return [NgramProposer]
