"""Closing a structured output within its token budget.

A small model can keep a JSON document open until `max_tokens` cuts it (the
digits of an unbounded number, the keys of an open object). A request that asks
for `StructuredOutputsParams(close_within_max_tokens=True)` gets its document
closed instead: near the end of its budget the engine computes a way to finish
the document from the grammar's current state (`ClosingPolicy.path`) and, once
the budget left is no more than that path's length plus `CLOSING_SLACK`, masks
every row to the path's next token.

The path is found through the `Grammar` contract alone (fill_bitmask, accept,
rollback, is_terminated), so every backend gets it: a greedy walk over
single-character tokens, simulated and rolled back. It prefers EOS, then the
characters that close something (`}` `]` `"`) or move on to the next required
part (`,` `:`), then the character used least in the last `HISTORY_WINDOW`
tokens (ties by a fixed order: digits, punctuation, letters, openers, space),
so that a pattern like `(ab)+c` reaches its `c` instead of repeating `ab`.

The walk is a function of the grammar's state and the tokens written so far
only. So the path from the state after its first token is the rest of the
same path: once the engine forces a path it follows it to EOS without
recomputing, speculation sees the same masks as plain decoding at every
position, and a preempted request (whose grammar and tokens are kept) resumes
on the same path. Between walks, a path is taken to grow by at most
`CLOSING_SLACK` per token (the bound the slack itself assumes), so a request
far from its budget is not walked every step.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence

import numpy
import torch

from kvforge.core.structured_output import Grammar, Vocabulary

FIRST = '"}],:'
"""Characters taken whenever the grammar allows them (after EOS), in this order:
they close a string, object or array, or move to the next item or value."""
RANKED = ("0123456789" + "!#$%&'()*+-./;<=>?@^_`|~" + "abcdefghijklmnopqrstuvwxyz"
          + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "{[\\ ")
"""The order that breaks ties among the other characters: digits first (`0` is the
shortest number), openers and space last, since they lengthen the document (and
space may loop in pretty-printed JSON)."""
HISTORY_WINDOW = 16
"""Tokens (written and simulated) over which the walk counts how often it used a character."""
CLOSING_WINDOW = 128
"""Budget left (in tokens) below which the engine computes closing paths at all:
earlier the model writes freely and the mask costs nothing extra. It must exceed a
closing path plus `CLOSING_SLACK` (an object of eight required fields takes about 80)."""
CLOSING_SLACK = 24
"""Tokens of budget kept beyond the closing path before it is forced: one free token
may lengthen the path (an object whose required keys must all be written), and the
budget must still hold the longer path."""


class ClosingPolicy:
    """Finds a way to finish a grammar's document with single-character tokens
    of `vocabulary` (any allowed token when no such one is allowed)."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        eos = [i for i in vocabulary.eos_token_ids if i < vocabulary.vocab_size]
        by_char: dict[str, int] = {}
        for token_id, data in enumerate(vocabulary.token_bytes):
            if len(data) == 1 and token_id not in vocabulary.special_token_ids:
                by_char.setdefault(chr(data[0]), token_id)
        order = [c for c in FIRST + RANKED if c in by_char]
        self.num_first = len(eos) + sum(c in by_char for c in FIRST)
        self._set_candidates(eos + [by_char[c] for c in order])
        # one scratch row, so a walk allocates nothing (walks run on the step loop's thread only)
        self._row = torch.zeros(1, vocabulary.bitmask_words, dtype=torch.int32)
        self._row_words = self._row.numpy()[0]  # the same memory: numpy reads a few words far faster than torch

    def _set_candidates(self, candidates: list[int]) -> None:
        """The tokens a walk considers, most preferred first."""
        self.candidates = candidates
        ids = numpy.array(candidates, dtype=numpy.int64)
        self._words, self._bits = ids // 32, (ids % 32).astype(numpy.int32)

    def path(self, grammar: Grammar, history: Sequence[int], limit: int) -> list[int] | None:
        """The tokens (the last one EOS) that finish `grammar`'s document, written
        after `history` (the output so far); None if it takes more than `limit`
        tokens or the grammar allows nothing. The grammar ends as it began."""
        recent = list(history[-HISTORY_WINDOW:])
        path: list[int] = []
        try:
            while not grammar.is_terminated():
                if len(path) >= limit:
                    return None
                token = self._next(grammar, recent)
                if token is None or not grammar.accept_tokens([token]):
                    return None
                path.append(token)
                recent = recent[1 - HISTORY_WINDOW:] + [token]
            return path
        finally:
            grammar.rollback(len(path))

    def _next(self, grammar: Grammar, recent: list[int]) -> int | None:
        grammar.fill_bitmask(self._row, 0)
        allowed = numpy.flatnonzero((self._row_words[self._words] >> self._bits) & 1).tolist()
        if allowed and allowed[0] < self.num_first:
            return self.candidates[allowed[0]]
        counts = Counter(recent)
        best = min(allowed, key=lambda i: (counts[self.candidates[i]], i), default=None)
        if best is not None:
            return self.candidates[best]
        return self._any_allowed()

    def _any_allowed(self) -> int | None:
        """The shortest allowed token (no single-character one is): `self._row` unpacked."""
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((self._row[0].unsqueeze(-1) >> shifts) & 1).flatten()[:len(self.vocabulary.token_bytes)]
        allowed = bits.nonzero().flatten().tolist()
        return min(allowed, key=lambda i: (len(self.vocabulary.token_bytes[i]), i), default=None)


class Closer:
    """The engine's side: per request (with `close_within_max_tokens`) the token a
    mask row is forced to, or None. Remembers each request's last path, so a
    request following it costs no new walk."""

    def __init__(self, vocabulary: Vocabulary, *, window: int = CLOSING_WINDOW, slack: int = CLOSING_SLACK):
        self.policy = ClosingPolicy(vocabulary)
        self.window = window
        self.slack = slack
        self._paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> (history, path)
        self.forced_rows = 0

    def forced_token(self, request, grammar: Grammar, draft: Sequence[int]) -> int | None:
        """The token the row after `request`'s output and `draft` (which `grammar`
        has accepted) must be, when the budget left there is down to its closing path."""
        left = request.params.max_tokens - len(request.output_token_ids) - len(draft)
        if left > self.window or left <= 0:
            return None
        history = list(request.output_token_ids) + list(draft)
        path = self._remembered(request, history, left)
        if path is None:
            path = self.policy.path(grammar, history, left)
            if path is None:
                return None
            self._paths[request] = (history, path)
        if not path or left > len(path) + self.slack:
            return None
        self.forced_rows += 1
        return path[0]

    def _remembered(self, request, history: list[int], left: int) -> list[int] | None:
        """From the request's last walk, when `history` extends the one it started from:
        the rest of its path if `history` followed it; [] (nothing to force) while the
        path cannot have grown to the budget left; else None (walk again)."""
        entry = self._paths.get(request)
        if entry is None:
            return None
        start, path = entry
        done = len(history) - len(start)
        # the same tokens up to the walk's start (a row after other draft tokens has
        # another history of the same length)
        if done < 0 or history[:len(start)] != start:
            return None
        if done < len(path) and history[len(start):] == path[:done]:
            return path[done:]
        # each token since may have lengthened the path by up to `slack` (the bound the
        # forcing itself relies on): walk again only once that could reach the budget
        return [] if left > len(path) + (done + 1) * self.slack else None
