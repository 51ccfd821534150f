"""The fast paths of the built-in backends' masks give bit-identical results:
the precomputed rows around a library's fill keep the per-row rule (the library's
row, never a special or padding token, EOS exactly when the output is complete),
and xgrammar's apply, whichever op it picks for a mask, equals the reference."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from kvforge.conformance.structured_corpus import MERGED, TINY
from kvforge.core import StructuredOutputSpec, apply_token_bitmask
from kvforge.plugins.structured_output.bitmask_apply import KERNEL_MAX_FORBIDDING_WORDS, forbidding_share
from kvforge.plugins.structured_output.llguidance_backend import LlguidanceBackend
from kvforge.plugins.structured_output.outlines_backend import OutlinesBackend
from kvforge.plugins.structured_output.tracked_grammar import TrackedGrammar
from kvforge.plugins.structured_output.xgrammar_backend import XgrammarBackend

BACKENDS = [XgrammarBackend, LlguidanceBackend, OutlinesBackend]
SPECS = [StructuredOutputSpec("choice", ("yes", "no", "maybe")),
         StructuredOutputSpec("regex", "[a-c]{1,3}(x|yz)?"),
         StructuredOutputSpec("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"]}))]
VOCABULARIES = {
    "tiny": TINY,
    "merged": MERGED,
    # EOS not among the special tokens, and a second EOS id among the padding ids
    "eos-not-special": dataclasses.replace(MERGED, eos_token_ids=(0, MERGED.vocab_size - 1),
                                           special_token_ids=frozenset({1})),
}


def per_row_fill(grammar, bitmask: torch.Tensor, row: int) -> None:
    """The rule written one token at a time, as the backends applied it before the
    precomputed rows: the library's row, less every id that is not a tokenizer
    token or is a special one, then each EOS bit set exactly when complete."""
    if grammar.is_terminated():
        bitmask[row].zero_()
        return
    vocabulary = grammar.vocabulary
    grammar._fill_library(bitmask, row)
    for token_id in range(bitmask.shape[-1] * 32):
        word, bit = divmod(token_id, 32)
        never = token_id >= len(vocabulary.token_bytes) or token_id in vocabulary.special_token_ids
        if token_id in vocabulary.eos_token_ids:
            never = not grammar._complete()
        if never:
            bitmask[row, word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
        elif token_id in vocabulary.eos_token_ids:
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)


class EverythingLibrary(TrackedGrammar):
    """A library that allows every id, padding and special ones included (the
    worst a library may do), complete when told."""

    def __init__(self, vocabulary, complete: bool):
        super().__init__(vocabulary)
        self.complete = complete

    def _advance(self, token_id: int) -> bool:
        return True

    def _undo(self, num_tokens: int) -> None:
        pass

    def _complete(self) -> bool:
        return self.complete

    def _fill_library(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1


def bits(row: torch.Tensor) -> list[int]:
    return torch.nonzero(((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()).flatten().tolist()


def test_the_rule_written_per_token_is_what_the_fast_fill_must_match():
    # the reference itself: EOS appears exactly on completion, specials and padding never
    grammar = XgrammarBackend(MERGED).compile(SPECS[0])
    bitmask = torch.full((1, MERGED.bitmask_words), -1, dtype=torch.int32)
    per_row_fill(grammar, bitmask, 0)
    assert 0 not in bits(bitmask[0]) and 1 not in bits(bitmask[0])
    assert grammar.accept_tokens([2 + ord(c) for c in "no"])
    per_row_fill(grammar, bitmask, 0)
    assert bits(bitmask[0]) == [0]


@pytest.mark.parametrize("vocabulary", VOCABULARIES.values(), ids=VOCABULARIES)
@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_fill_is_bit_identical_to_the_per_token_rule_along_random_walks(cls, vocabulary):
    backend = cls(vocabulary)
    rng = random.Random(f"{cls.name}-{vocabulary.vocab_size}")
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    checked = completions = 0
    for spec in SPECS:
        if cls.spec_unsupported_reasons(spec):
            continue
        for _ in range(4):
            grammar = backend.compile(spec)
            for _ in range(12):
                # rows start as garbage: whatever the fill leaves of it must agree too
                fast = torch.randint(-2**31, 2**31 - 1, (3, vocabulary.bitmask_words), dtype=torch.int32,
                                     generator=generator)
                slow = fast.clone()
                grammar.fill_bitmask(fast, 1)
                per_row_fill(grammar, slow, 1)
                assert torch.equal(fast, slow), f"{cls.name} {spec.kind}: rows differ after {checked} checks"
                checked += 1
                allowed = bits(fast[1])
                if not allowed:
                    break
                completions += any(t in vocabulary.eos_token_ids for t in allowed)
                assert grammar.accept_tokens([rng.choice(allowed)])
    assert checked > 20 and completions > 0  # the walks reached complete outputs, where EOS is set


@pytest.mark.parametrize("complete", [False, True])
@pytest.mark.parametrize("vocabulary", VOCABULARIES.values(), ids=VOCABULARIES)
def test_fill_keeps_padding_specials_and_eos_to_the_rule_whatever_the_library_allows(vocabulary, complete):
    grammar = EverythingLibrary(vocabulary, complete)
    fast = torch.zeros((2, vocabulary.bitmask_words), dtype=torch.int32)
    slow = fast.clone()
    grammar.fill_bitmask(fast, 0)
    per_row_fill(grammar, slow, 0)
    assert torch.equal(fast, slow)
    assert set(vocabulary.eos_token_ids) <= set(bits(fast[0])) if complete else \
        not set(vocabulary.eos_token_ids) & set(bits(fast[0]))


def random_bitmask(rows: int, words: int, forbidding: float, generator: torch.Generator) -> torch.Tensor:
    """Words all-allowed but a `forbidding` share, which forbid at random (some forbid everything)."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    bitmask[torch.rand(rows, words, generator=generator) < 0.3] = 0
    bitmask[bitmask == -1] = 0
    bitmask[torch.rand(rows, words, generator=generator) >= forbidding] = -1
    return bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("forbidding", [0.0, 0.05, 0.3, 0.5, 0.9, 1.0])
def test_xgrammar_apply_equals_the_reference_whichever_op_it_picks(forbidding, dtype):
    backend = XgrammarBackend(MERGED)
    generator = torch.Generator().manual_seed(int(forbidding * 100) + dtype.itemsize)
    vocab = MERGED.vocab_size  # not a multiple of 32: the last word's high bits lie past the logits
    bitmask = random_bitmask(6, MERGED.bitmask_words, forbidding, generator)
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    fast, slow = logits.clone(), logits.clone()
    backend.apply_bitmask(fast, bitmask)
    apply_token_bitmask(slow, bitmask)
    assert torch.equal(fast, slow)
    # a subset of rows: the bitmask's rows belong to logits rows 1, 3, 4
    fast, slow = logits.clone(), logits.clone()
    backend.apply_bitmask(fast, bitmask[:3], [1, 3, 4])
    apply_token_bitmask(slow, bitmask[:3], [1, 3, 4])
    assert torch.equal(fast, slow)


def test_both_ops_are_exercised_by_the_densities_above(monkeypatch):
    calls = []
    backend = XgrammarBackend(MERGED)
    monkeypatch.setattr(backend, "_kernel", lambda *args: calls.append("kernel"))
    generator = torch.Generator().manual_seed(0)
    for forbidding in (0.05, 0.9):
        bitmask = random_bitmask(6, MERGED.bitmask_words, forbidding, generator)
        assert (forbidding_share(bitmask) <= KERNEL_MAX_FORBIDDING_WORDS) == (forbidding < 0.5)
        backend.apply_bitmask(torch.zeros(6, MERGED.vocab_size), bitmask)
    assert calls == ["kernel"]  # the sparse mask went to the torch op
