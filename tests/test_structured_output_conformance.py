"""The structured_output conformance checks can fail: a simple correct backend
(tests/planted/structured_outputs.py's `ChoiceTrie`) passes every one, and each
planted variant is caught by the check written for the guarantee it breaks."""

from __future__ import annotations

import pytest

from kvforge.conformance import check_structured_output as check
from kvforge.conformance import check_structured_output_engine as engine_check
from kvforge.conformance.selection import QUICK_ENV
from kvforge.conformance.structured_corpus import TINY
from kvforge.core import STRUCTURED_OUTPUT, Registry, build_registry, hookimpl
from kvforge.plugins.structured_output.xgrammar_backend import XgrammarBackend
from kvforge.models import load_tokenizer
from tests.planted.structured_outputs import (
    ChoiceTrie,
    EosNeverAllowed,
    EosOneTokenEarly,
    IgnoresAdditionalPropertiesFalse,
    IgnoresCompactWhitespace,
    MaskOffByOneBit,
    RollbackForgetsOneToken,
)

BROKEN = [MaskOffByOneBit, EosOneTokenEarly, RollbackForgetsOneToken, EosNeverAllowed,
          IgnoresAdditionalPropertiesFalse, IgnoresCompactWhitespace]


class _Plugin:
    @hookimpl
    def kvforge_implementations(self):
        return [ChoiceTrie, *BROKEN]


@pytest.fixture(scope="module")
def registry():
    registry = Registry(strict=True)
    registry.register_plugin(_Plugin(), "structured-mutants")
    return registry


def registration(registry, cls):
    return registry.get(STRUCTURED_OUTPUT, cls.name)


def test_a_correct_backend_passes_every_check(registry):
    trie = registration(registry, ChoiceTrie)
    check.test_declares_what_it_compiles_and_refuses_the_rest_with_reasons(trie)
    for vocabulary in sorted(check.VOCABULARIES):
        check.test_every_walk_through_the_corpus_keeps_the_guarantees(trie, vocabulary)
        check.test_hypothesis_walks_keep_the_guarantees(trie, vocabulary)
    check.test_compile_is_safe_from_several_threads(trie)
    for dtype in (check.torch.float32, check.torch.bfloat16):
        check.test_apply_bitmask_masks_exactly_the_clear_bits(trie, dtype)


@pytest.mark.parametrize("cls, message", [
    (MaskOffByOneBit, "for a token the mask allowed"),
    (EosOneTokenEarly, "EOS is allowed but the output so far is not a complete document"),
    (RollbackForgetsOneToken, "did not restore the mask"),
    (EosNeverAllowed, "the mask is empty before termination"),
], ids=lambda value: getattr(value, "name", "message"))
def test_each_planted_grammar_bug_is_caught_by_the_corpus_walks(registry, cls, message):
    with pytest.raises(AssertionError, match=message):
        check.test_every_walk_through_the_corpus_keeps_the_guarantees(registration(registry, cls), "kvforge-tiny")


def test_ignoring_additional_properties_false_is_caught_by_the_judge(registry):
    with pytest.raises(AssertionError, match="not a complete document"):
        check.test_every_walk_through_the_corpus_keeps_the_guarantees(
            registration(registry, IgnoresAdditionalPropertiesFalse), "kvforge-tiny")


def test_whitespace_in_a_compact_json_spec_is_caught_by_the_walks(registry):
    with pytest.raises(AssertionError, match="is compact .* but the walk wrote whitespace outside a string"):
        check.test_every_walk_through_the_corpus_keeps_the_guarantees(
            registration(registry, IgnoresCompactWhitespace), "kvforge-tiny")


def test_a_grammar_that_never_ends_is_caught_even_where_its_mask_never_empties(registry, monkeypatch):
    class EndlessTrie(EosNeverAllowed):
        """Never allows EOS, and lets every choice go on with spaces."""

        name = "endless"

        def compile(self, spec):
            return super().compile(type(spec)(spec.kind, tuple(c + " " * 300 for c in spec.value)))

    registry.register_plugin(type("P", (), {"kvforge_implementations": hookimpl(lambda self: [EndlessTrie])})(),
                             "endless")
    with pytest.raises(AssertionError, match="walks of endless over kvforge-tiny ended"):
        check.test_every_walk_through_the_corpus_keeps_the_guarantees(registration(registry, EndlessTrie),
                                                                       "kvforge-tiny")


def test_the_tiny_vocabulary_is_kvforge_tiny_s_tokenizer():
    tokenizer = load_tokenizer("kvforge-tiny")
    assert TINY.eos_token_ids == (tokenizer.eos_token_id,)
    assert len(TINY.token_bytes) == TINY.vocab_size == tokenizer.vocab_size
    assert TINY.special_token_ids == {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert all(TINY.token_bytes[i] == bytes([i]) == tokenizer.decode([i]).encode() for i in range(128))


class MasksNothing(XgrammarBackend):
    """xgrammar whose `apply_bitmask` leaves the logits as they are: the engine samples unconstrained."""

    name = "masks-nothing"

    def apply_bitmask(self, logits, bitmask, rows=None):
        pass


@pytest.mark.parametrize("cls, caught", [(XgrammarBackend, False), (MasksNothing, True)],
                         ids=["xgrammar", "masks-nothing"])
def test_the_engine_group_passes_xgrammar_and_catches_masks_left_unapplied(monkeypatch, cls, caught):
    monkeypatch.setenv(QUICK_ENV, "1")  # a seeded sample of the corpus's JSON schemas
    registry = build_registry()
    if cls is MasksNothing:
        registry.register_plugin(type("P", (), {"kvforge_implementations": hookimpl(lambda self: [cls])})(), "masks")
    monkeypatch.setattr(engine_check, "registry", lambda: registry)
    registration = registry.get(STRUCTURED_OUTPUT, cls.name)
    if not caught:
        engine_check.test_sampled_outputs_validate(registration, "plain")
        return
    with pytest.raises(AssertionError, match="refuses the output|ended with 'error'"):
        engine_check.test_sampled_outputs_validate(registration, "plain")
