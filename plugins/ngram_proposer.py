"""The `ngram` speculative proposer: prompt lookup.

The longest suffix n-gram of a request's tokens (n from `max_n` down to
`min_n`) is looked up earlier in the same tokens (prompt and output); at its
most recent occurrence, the tokens that followed it are the draft. It costs no
model, and pays off wherever the output repeats its input: code edits, quoted
text, summaries, retrieval answers.

Per step and request the work is one vectorized comparison over the request's
tokens (`O(len · max_n)` element compares in torch, no Python loop over
tokens); the tokens themselves are kept per request and only the new ones are
copied in each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.core import ConfigError, DraftProposal, ProposalRequest, SpeculativeProposer, hookimpl


class _History:
    """One request's tokens as a growing int64 tensor (amortized O(1) per token)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(64, dtype=torch.int64)
        self.length = 0

    def sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The tokens of `token_ids` as a tensor, copying in only those not seen yet."""
        n = len(token_ids)
        if n < self.length or (self.length and int(self.buffer[self.length - 1]) != token_ids[self.length - 1]):
            self.length = 0  # not the sequence we followed (an id reused): start over
        if n > self.buffer.numel():
            grown = torch.empty(max(n, 2 * self.buffer.numel()), dtype=torch.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if n > self.length:
            self.buffer[self.length: n] = torch.as_tensor(token_ids[self.length: n], dtype=torch.int64)
            self.length = n
        return self.buffer[:n]


def ngram_lookup(tokens: torch.Tensor, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram of `tokens` (`min_n <= n <= max_n`); [] when none occurs."""
    length = tokens.numel()
    if length < min_n + 1 or k <= 0:
        return []
    max_n = min(max_n, length - 1)
    # ends[i] is a candidate n-gram end; it must leave at least one token after it.
    ends = torch.arange(min_n - 1, length - 1)
    back = torch.arange(max_n)
    # match[i, m]: the token m places before candidate end i equals the one m places before the suffix end.
    before = ends.unsqueeze(1) - back
    match = (tokens[before.clamp(min=0)] == tokens[length - 1 - back]) & (before >= 0)
    run = match.to(torch.int32).cumprod(dim=1).sum(dim=1)  # matched suffix length at each end
    best = int(run.max())
    if best < min_n:
        return []
    # The most recent of the longest matches: its continuation is the freshest guess.
    end = int(ends[(run == best).nonzero()[-1]])
    return tokens[end + 1: end + 1 + k].tolist()


class NgramProposer(SpeculativeProposer):
    """Prompt-lookup drafts. Options (`speculative.options`):

    * `min_n` (default 2): the shortest n-gram worth matching. A single shared
      token is mostly coincidence on natural text ("the", ","), so n = 1 drafts
      are rejected often and cost verification work for little gain.
    * `max_n` (default 4): the longest n-gram tried; longer matches are more
      reliable but rarer, and the lookup costs `max_n` compares per token.
    """

    name = "ngram"

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
