"""Conformance of every `structured_output` backend: the guarantees in
`kvforge.core.structured_output`'s `Grammar` and `StructuredOutputBackend`
docstrings, checked by token walks through the masks.

Each backend is built over two vocabularies (`structured_corpus.VOCABULARIES`:
kvforge-tiny's byte-level one and a multi-byte one) and walks every spec of the
corpus it does not refuse: JSON schemas (the `jsonschema` package judges each
finished document), regexes and choices. `structured_walks.Walker` checks every
step. A backend that needs options gets them from `OPTIONS_ENV`.
"""

from __future__ import annotations

import json
import os
import random
import threading

import pytest
import torch

from kvforge.core import (
    SPEC_KINDS,
    STRUCTURED_OUTPUT,
    KvforgeError,
    Registration,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    apply_token_bitmask,
)
from kvforge.core.structured_output import GRAMMAR, JSON, JSON_OBJECT

from .applicability import not_applicable
from .attention_cases import SEED_ENV
from .selection import QuickGrid, quick
from .structured_corpus import INVALID_GRAMMARS, INVALID_SPECS, VOCABULARIES, Case, corpus, with_any_whitespace

KIND = STRUCTURED_OUTPUT
GROUP = "grammars"

OPTIONS_ENV = "KVFORGE_CONFORMANCE_STRUCTURED_OPTIONS"
"""JSON `{"backend name": {option: value}}`: options for backends that need some."""
QUICK_CASES = 40
"""Corpus cases walked under --quick (every JSON-schema family, regex and choice stays represented)."""
HYPOTHESIS_WALKS = QuickGrid(full=(60,), quick=(15,))


def backend(registration: Registration, vocabulary_name: str) -> StructuredOutputBackend:
    """A fresh instance over the named vocabulary; skips one that cannot run here or refuses to be built."""
    availability = registration.availability()
    if not availability.ok:
        pytest.skip(f"unavailable: {availability.reason}")
    options = json.loads(os.environ.get(OPTIONS_ENV) or "{}").get(registration.name, {})
    try:
        return registration.cls(VOCABULARIES[vocabulary_name], **options)
    except KvforgeError as exc:
        pytest.skip(f"{registration.name} cannot be built over the {vocabulary_name} vocabulary: {exc} "
                    f"(give it options with {OPTIONS_ENV})")


def seed() -> int:
    return int(os.environ.get(SEED_ENV) or 0)


def supported(instance: StructuredOutputBackend) -> list[Case]:
    """The corpus cases the backend does not refuse; under --quick a seeded sample of them."""
    cases = [case for case in corpus() if not instance.spec_unsupported_reasons(case.spec)]
    if not cases:
        not_applicable(f"{instance.name} compiles none of the corpus's JSON, regex and choice specs")
    if quick() and len(cases) > QUICK_CASES:
        cases = random.Random(seed()).sample(cases, QUICK_CASES)
    return cases


def both_layouts(cases: list[Case]) -> list[Case]:
    """`cases` with every other JSON case allowing any whitespace (the corpus's are compact)."""
    json_cases = [case for case in cases if case.spec.kind in (JSON, JSON_OBJECT)]
    flexible = {case.name for case in json_cases[1::2]}
    return [with_any_whitespace(case) if case.name in flexible else case for case in cases]


def test_declares_what_it_compiles_and_refuses_the_rest_with_reasons(registration):
    cls = registration.cls
    declared = set(cls.spec_kinds)
    assert declared and declared <= set(SPEC_KINDS), \
        f"spec_kinds {sorted(declared)} must be a non-empty subset of {list(SPEC_KINDS)}"
    assert (GRAMMAR in declared) == bool(cls.grammar_syntaxes), \
        "a backend that compiles grammar specs names their syntaxes in grammar_syntaxes, and only then"
    refused = [StructuredOutputSpec(kind) for kind in SPEC_KINDS if kind not in declared]
    refused += [StructuredOutputSpec("no_such_kind"), StructuredOutputSpec(GRAMMAR, "x", "no-such-syntax")]
    for spec in refused:
        reasons = cls.spec_unsupported_reasons(spec)
        assert reasons and all(isinstance(r, str) and r for r in reasons), \
            f"{spec.describe()} is not compiled by {cls.name}, but spec_unsupported_reasons gave {reasons!r}"
    request = type("Request", (), {"structured_output_spec": refused[-1]})()
    assert cls.unsupported_reasons(request), "unsupported_reasons must read the request's structured_output_spec"
    basic = [case for case in corpus() if case.basic and case.spec.kind in declared]
    refused_basic = [case.name for case in basic if cls.spec_unsupported_reasons(case.spec)]
    assert not refused_basic, f"{cls.name} compiles {sorted(declared)} but refuses the plain cases {refused_basic}"


def test_invalid_specs_raise_structured_output_error(registration):
    instance = backend(registration, "kvforge-tiny")
    specs = [spec for spec in INVALID_SPECS if spec.kind in instance.spec_kinds]
    specs += [StructuredOutputSpec(GRAMMAR, text, syntax) for syntax, text in INVALID_GRAMMARS.items()
              if GRAMMAR in instance.spec_kinds and syntax in instance.grammar_syntaxes]
    if not specs:
        not_applicable(f"the corpus has no invalid spec of the kinds {instance.name} compiles")
    for spec in specs:
        with pytest.raises(StructuredOutputError) as caught:
            instance.compile(spec)
        assert str(caught.value), f"the StructuredOutputError for an invalid {spec.describe()} says nothing"


@pytest.mark.parametrize("vocabulary", sorted(VOCABULARIES))
def test_every_walk_through_the_corpus_keeps_the_guarantees(registration, vocabulary):
    """One seeded walk per case: a random stretch of 0-40 tokens, then the finisher;
    most walks must end (every walk of the built-in backends does). Every other
    JSON case is walked with any whitespace allowed, the rest compact."""
    from .structured_walks import MAX_TOKENS, Walker

    instance = backend(registration, vocabulary)
    ended, cases = 0, both_layouts(supported(instance))
    for case in cases:
        rng = random.Random(f"{seed()}-{case.name}")
        stretch = rng.randint(0, 40)
        walk = Walker(instance, VOCABULARIES[vocabulary], case).run(
            lambda allowed, step: rng.randrange(len(allowed)) if step < stretch else None)
        ended += walk.terminated
    assert 2 * ended >= len(cases), (
        f"only {ended} of {len(cases)} walks of {instance.name} over {vocabulary} ended in a document within "
        f"{MAX_TOKENS} tokens, though each hands over to a finisher that takes EOS whenever the mask allows it: "
        "is EOS ever allowed? (guarantee 1)")


@pytest.mark.parametrize("vocabulary", sorted(VOCABULARIES))
def test_hypothesis_walks_keep_the_guarantees(registration, vocabulary):
    """Hypothesis picks the case, the length of the random stretch and every token of it."""
    from .structured_hypothesis import run_hypothesis_walks

    instance = backend(registration, vocabulary)
    run_hypothesis_walks(instance, VOCABULARIES[vocabulary], both_layouts(supported(instance)), HYPOTHESIS_WALKS[0])


def test_compile_is_safe_from_several_threads(registration):
    """Guarantee 3 of the backend: four threads compile the same specs at once, and
    every grammar starts with the mask a lone compile gives."""
    instance = backend(registration, "merged")
    cases = supported(instance)[:6]
    bitmask = instance.allocate_bitmask(1)
    expected = []
    for case in cases:
        instance.compile(case.spec).fill_bitmask(bitmask, 0)
        expected.append(bitmask[0].clone())
    results, errors = {}, []

    def compile_all(worker: int) -> None:
        try:
            for i, case in enumerate(cases):
                row = torch.zeros((1, instance.vocabulary.bitmask_words), dtype=torch.int32)
                instance.compile(case.spec).fill_bitmask(row, 0)
                results[worker, i] = row[0]
        except Exception as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=compile_all, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"compile raised from a thread: {errors[0]!r}"
    for (worker, i), row in results.items():
        assert torch.equal(row, expected[i]), f"{cases[i].name!r} compiled on thread {worker} starts with another mask"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_bitmask_masks_exactly_the_clear_bits(registration, dtype):
    """`apply_bitmask` equals the reference: all rows, a subset of rows, and logits
    wider than the mask (padding ids beyond it are never allowed)."""
    instance = backend(registration, "merged")
    generator = torch.Generator().manual_seed(seed())
    words = instance.vocabulary.bitmask_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=generator, dtype=torch.int64).to(torch.int32)
    for width, rows in ((words * 32, None), (instance.vocabulary.vocab_size, [4, 0, 2]), (words * 32 + 40, None)):
        logits = torch.randn(5 if rows else 3, width, generator=generator).to(dtype)
        expected = logits.clone()
        apply_token_bitmask(expected, bitmask, rows)
        instance.apply_bitmask(logits, bitmask, rows)
        assert torch.equal(logits, expected), \
            f"apply_bitmask differs from the reference for {width} logits per row, rows {rows}, {dtype}"
