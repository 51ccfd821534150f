"""The `ngram` speculative proposer: prompt lookup.

The longest suffix n-gram of a request's tokens (n from `max_n` down to
`min_n`) is looked up earlier in the same tokens (prompt and output); at its
most recent occurrence, the tokens that followed it are the draft, continued as
a repetition when they run into the end of the tokens. It costs no
model, and pays off wherever the output repeats its input: code edits, quoted
text, summaries, retrieval answers.

Per step and request the work is `max_n` vectorized comparisons over the
request's tokens (`O(len · max_n)` element compares in numpy, no Python loop
over tokens; numpy rather than torch because at these sizes the per-call
overhead dominates); the tokens are kept per request and only the new ones are
copied in each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.core import ConfigError, DraftProposal, ProposalRequest, SpeculativeProposer, cdiv, hookimpl


class _History:
    """One request's tokens as a growing int64 array (amortized O(1) per token)."""

    def __init__(self) -> None:
        self.buffer = np.empty(64, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The tokens of `token_ids` as an array, copying in only those not seen yet."""
        n = len(token_ids)
        if n < self.length or (self.length and self.buffer[self.length - 1] != token_ids[self.length - 1]):
            self.length = 0  # not the sequence we followed (an id reused): start over
        if n > self.buffer.size:
            grown = np.empty(max(n, 2 * self.buffer.size), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if n > self.length:
            self.buffer[self.length: n] = token_ids[self.length: n]
            self.length = n
        return self.buffer[:n]


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
            history = self.histories.setdefault(request.request_id, _History())
            tokens = history.sync(request.token_ids)
            proposals.append(DraftProposal(ngram_lookup(tokens, self.min_n, self.max_n, num_tokens)))
        return proposals

    def release(self, request_id: str) -> None:
        self.histories.pop(request_id, None)


@hookimpl
def kvforge_implementations():
    return [NgramProposer]
