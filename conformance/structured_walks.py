"""Token walks through a structured_output grammar's masks, checking the `Grammar`
guarantees at every step (kept apart from the check module so that listing the
check modules does not import hypothesis before pytest starts).

A walk takes tokens the mask allows, chosen by `choose` for a while (hypothesis or
a seeded generator), then by a finisher that prefers EOS, then closing
punctuation, then the smallest other token, so most walks end in a document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.core import Grammar, StructuredOutputBackend, Vocabulary
from kvforge.core.structured_output import JSON, JSON_OBJECT

from .structured_corpus import Case

MAX_TOKENS = 200
"""A walk that has not ended after this many tokens stops there, unjudged."""
_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_ids(row: torch.Tensor) -> list[int]:
    """The token ids whose bits are set in one bitmask row."""
    return torch.nonzero(((row.unsqueeze(-1) >> _SHIFTS) & 1).flatten()).flatten().tolist()


def finisher_ranks(vocabulary: Vocabulary) -> list[tuple[int, int]]:
    """Per token, how much the finisher wants it (lower first): EOS, closing
    punctuation, other printable ASCII, the rest, whitespace last."""
    ranks = []
    for i, token in enumerate(vocabulary.token_bytes):
        if i in vocabulary.eos_token_ids:
            rank = 0
        elif token and set(token) <= set(b'"}]'):
            rank = 1
        elif token and all(33 <= b < 127 for b in token):
            rank = 2
        elif token and not any(b in b" \t\r\n" for b in token):
            rank = 3
        else:
            rank = 4
        ranks.append((rank, i))
    return ranks


def whitespace_outside_strings(text: str) -> int | None:
    """The index of the first JSON whitespace character outside a string of `text`
    (a JSON document or a prefix of one), or None."""
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in " \t\n\r":
            return i
    return None


@dataclass
class Walk:
    tokens: list[int]
    terminated: bool
    text: str | None  # the output decoded as UTF-8; None if it is not valid UTF-8


class Walker:
    """Walks one compiled case of one backend over one vocabulary."""

    def __init__(self, backend: StructuredOutputBackend, vocabulary: Vocabulary, case: Case):
        self.backend, self.vocabulary, self.case = backend, vocabulary, case
        self.eos = set(vocabulary.eos_token_ids)
        self.forbidden = {i for i in vocabulary.special_token_ids if i not in self.eos}
        self.ranks = finisher_ranks(vocabulary)
        self.bitmask = torch.zeros((1, vocabulary.bitmask_words), dtype=torch.int32)

    def where(self, tokens: list[int]) -> str:
        shown = b"".join(self.vocabulary.token_bytes[t] for t in tokens)[-60:]
        return f"{self.case.name!r} after {len(tokens)} tokens (text ending {shown!r})"

    def mask(self, grammar: Grammar) -> torch.Tensor:
        self.bitmask.fill_(-1)  # a grammar must write every word of its row
        grammar.fill_bitmask(self.bitmask, 0)
        return self.bitmask[0].clone()

    def text(self, tokens: list[int]) -> str | None:
        # surrogatepass: xgrammar lets UTF-8-encoded surrogates into JSON strings; read as the
        # code points they spell, the document still parses and validates
        try:
            return b"".join(self.vocabulary.token_bytes[t] for t in tokens).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None

    def run(self, choose: Callable[[list[int], int], int | None], max_tokens: int = MAX_TOKENS) -> Walk:
        """`choose(allowed, step)` returns an index into `allowed`, or None to hand over to the finisher."""
        grammar = self.backend.compile(self.case.spec)
        tokens: list[int] = []
        masks: list[torch.Tensor] = []
        finishing = False
        for step in range(max_tokens):
            mask = self.mask(grammar)
            assert torch.equal(mask, self.mask(grammar)), \
                f"the same state gave two different masks at {self.where(tokens)} (guarantee 6)"
            allowed = allowed_ids(mask)
            self.check_layout(allowed, tokens)
            self.check_eos(allowed, tokens)
            index = None if finishing else choose(allowed, step)
            finishing = finishing or index is None
            token = min(self.ranks[i] for i in allowed)[1] if finishing else allowed[index]
            self.check_acceptance(grammar, mask, allowed, token, tokens, step)
            assert grammar.accept_tokens([token]), \
                f"accept_tokens([{token}]) returned False for a token the mask allowed at {self.where(tokens)} " \
                "(guarantees 1 and 2)"
            masks.append(mask)
            tokens.append(token)
            if token in self.eos:
                assert grammar.is_terminated(), f"EOS was accepted but is_terminated() is False at {self.where(tokens)}"
                break
            assert not grammar.is_terminated(), f"is_terminated() is True without an EOS at {self.where(tokens)}"
        walk = Walk(tokens, grammar.is_terminated(), self.text([t for t in tokens if t not in self.eos]))
        self.check_compact(walk)
        if walk.terminated:
            self.check_terminated(grammar, tokens)
        self.check_rollback(grammar, masks, tokens, walk.terminated)
        self.check_validate(grammar, masks, tokens)
        return walk

    def check_compact(self, walk: Walk) -> None:
        """A JSON spec without `any_whitespace` allows no whitespace outside strings
        (guarantee 2 of the backend), in a finished document or a prefix of one."""
        spec = self.case.spec
        if spec.kind not in (JSON, JSON_OBJECT) or spec.any_whitespace or walk.text is None:
            return
        at = whitespace_outside_strings(walk.text)
        assert at is None, (
            f"{self.case.name!r} is compact (any_whitespace=False) but the walk wrote whitespace outside a string "
            f"at character {at} of {walk.text[max(0, at - 40):at + 1]!r} (guarantee 2 of the backend)")

    def check_layout(self, allowed: list[int], tokens: list[int]) -> None:
        assert allowed, f"the mask is empty before termination at {self.where(tokens)} (guarantee 1)"
        beyond = [i for i in allowed if i >= len(self.vocabulary.token_bytes)]
        assert not beyond, f"the mask allows ids past the tokenizer's tokens {beyond[:5]} at {self.where(tokens)}"
        special = sorted(self.forbidden.intersection(allowed))
        assert not special, f"the mask allows special tokens {special[:5]} that are not EOS at {self.where(tokens)}"

    def check_eos(self, allowed: list[int], tokens: list[int]) -> None:
        """EOS only when the output is complete. Not the converse: a grammar may be
        narrower than its schema (xgrammar closes objects by default; llguidance
        writes no "-0"), so a text the judge accepts may be only a prefix to it."""
        if not self.eos.intersection(allowed):
            return
        text = self.text(tokens)
        assert text is not None and self.case.accepts(text), (
            f"EOS is allowed but the output so far is not a complete document at {self.where(tokens)} "
            "(guarantee 1)")

    def check_acceptance(self, grammar: Grammar, mask: torch.Tensor, allowed: list[int], token: int,
                         tokens: list[int], step: int) -> None:
        """The mask and acceptance agree: the chosen token validates; a token the mask
        refuses neither validates nor is accepted, and refusing it changes nothing."""
        assert grammar.validate_tokens([token]) == 1, \
            f"validate_tokens([{token}]) is 0 for a token the mask allowed at {self.where(tokens)} (guarantee 3)"
        refused = set(range(len(self.vocabulary.token_bytes))) - set(allowed)
        if refused:
            other = sorted(refused)[(step * 7919 + token) % len(refused)]
            assert grammar.validate_tokens([other]) == 0, \
                f"validate_tokens([{other}]) is 1 for a token the mask refused at {self.where(tokens)} (guarantee 3)"
            assert not grammar.accept_tokens([other]), \
                f"accept_tokens([{other}]) returned True for a token the mask refused at {self.where(tokens)} " \
                "(guarantee 2)"
            assert torch.equal(self.mask(grammar), mask), \
                f"a refused accept_tokens changed the state at {self.where(tokens)} (guarantee 2)"

    def check_terminated(self, grammar: Grammar, tokens: list[int]) -> None:
        assert self.case.accepts(self.text(tokens[:-1]) or ""), \
            f"the walk ended on EOS with an output the spec does not allow at {self.where(tokens)} " \
            f"(guarantee 2 of the backend)"
        any_token = min(self.ranks)[1]
        assert grammar.validate_tokens([any_token]) == 0 and not grammar.accept_tokens([any_token]), \
            f"a terminated grammar accepted another token at {self.where(tokens)} (guarantee 5)"
        assert not allowed_ids(self.mask(grammar)), \
            f"a terminated grammar's mask allows tokens at {self.where(tokens)} (guarantee 5)"

    def check_rollback(self, grammar: Grammar, masks: list[torch.Tensor], tokens: list[int], terminated: bool) -> None:
        for k in sorted({1, 2, len(tokens) // 2, len(tokens)} - {0}):
            grammar.rollback(k)
            assert not grammar.is_terminated(), f"is_terminated() after rolling back {k} tokens of {self.where(tokens)}"
            assert torch.equal(self.mask(grammar), masks[-k]), \
                f"rolling back {k} tokens did not restore the mask at {self.where(tokens[:-k])} (guarantee 4)"
            assert grammar.accept_tokens(tokens[-k:]), \
                f"re-accepting {k} rolled-back tokens failed at {self.where(tokens[:-k])} (guarantee 4)"
            assert grammar.is_terminated() == terminated

    def check_validate(self, grammar: Grammar, masks: list[torch.Tensor], tokens: list[int]) -> None:
        grammar.rollback(len(tokens))
        assert torch.equal(self.mask(grammar), masks[0]), \
            f"rolling back every token did not restore the first mask of {self.where(tokens)} (guarantee 4)"
        refused = [i for i in range(len(self.vocabulary.token_bytes)) if i not in allowed_ids(masks[-1])]
        probe = tokens[:-1] + refused[:1] if refused else tokens
        expected = len(tokens) - 1 if refused else len(tokens)
        assert grammar.validate_tokens(probe) == expected, \
            f"validate_tokens over the walk plus a refused token disagrees with step-by-step acceptance: " \
            f"{grammar.validate_tokens(probe)} of {len(probe)}, expected {expected}, for {self.where(tokens)} " \
            "(guarantee 3)"
        assert torch.equal(self.mask(grammar), masks[0]), f"validate_tokens changed the state of {self.where(tokens)}"
        assert grammar.validate_tokens(tokens) == len(tokens) and grammar.accept_tokens(tokens)
