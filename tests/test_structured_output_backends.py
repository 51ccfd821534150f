"""The built-in structured_output backends beyond what conformance checks: `auto`
picks per spec, each refuses what its library cannot keep (and says which backend
can), a missing library says how to install it, and the library quirks each
backend works around stay worked around."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kvforge.conformance.structured_corpus import MERGED, TINY
from kvforge.core import STRUCTURED_OUTPUT, SelectionError, SelectionRequest, StructuredOutputSpec, build_registry
from kvforge.plugins.structured_output.llguidance_backend import LlguidanceBackend
from kvforge.plugins.structured_output.outlines_backend import OutlinesBackend
from kvforge.plugins.structured_output.tracked_grammar import choice_regex
from kvforge.plugins.structured_output.xgrammar_backend import XgrammarBackend

BACKENDS = [XgrammarBackend, LlguidanceBackend, OutlinesBackend]
RANGED = StructuredOutputSpec("json", json.dumps({"type": "integer", "minimum": 3, "maximum": 7}))


def auto(spec: StructuredOutputSpec) -> str:
    request = SelectionRequest(structured_output_spec=spec)
    return build_registry(environ={}).select(STRUCTURED_OUTPUT, "auto", request).name


def allowed(grammar, vocabulary) -> list[int]:
    bitmask = torch.zeros((1, vocabulary.bitmask_words), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()).flatten().tolist()


def test_auto_picks_per_spec_the_highest_priority_backend_that_compiles_it():
    assert auto(StructuredOutputSpec("json", "{}")) == "xgrammar"
    assert auto(StructuredOutputSpec("grammar", 'root ::= "a"', "ebnf")) == "xgrammar"
    assert auto(StructuredOutputSpec("grammar", 'start: "a"', "lark")) == "llguidance"
    with pytest.raises(SelectionError, match="outlines does not enforce 'maximum', 'minimum'"):
        build_registry(environ={}).select(STRUCTURED_OUTPUT, "outlines", SelectionRequest(structured_output_spec=RANGED))


def test_each_refusal_names_what_is_missing_and_who_can():
    assert OutlinesBackend.spec_unsupported_reasons(RANGED) == [
        "outlines does not enforce 'maximum', 'minimum' in JSON schemas (xgrammar and llguidance do)"]
    (reason,) = OutlinesBackend.spec_unsupported_reasons(StructuredOutputSpec("json_object"))
    assert "does not compile 'json_object'" in reason
    (reason,) = LlguidanceBackend.spec_unsupported_reasons(StructuredOutputSpec("grammar", "x", "ebnf"))
    assert "does not read 'ebnf' grammars (it reads lark)" in reason


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_a_missing_library_says_how_to_install_it(cls, monkeypatch):
    assert cls.availability().ok
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "xgrammar", "llguidance", "outlines_core") else real(name, *a))
    availability = cls.availability()
    assert not availability.ok and "pip install 'kvforge[structured]'" in availability.reason


def test_xgrammar_keeps_control_characters_out_of_length_bounded_strings():
    # xgrammar's own grammar for a maxLength string allows raw control bytes, which JSON forbids
    grammar = XgrammarBackend(TINY).compile(StructuredOutputSpec("json", json.dumps({"type": "string", "maxLength": 3})))
    assert grammar.accept_tokens([ord('"')])
    assert not set(range(32)) & set(allowed(grammar, TINY)) and ord("a") in allowed(grammar, TINY)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_padding_ids_and_special_tokens_are_never_allowed(cls):
    grammar = cls(MERGED).compile(StructuredOutputSpec("json", json.dumps({"type": "string"})))
    assert grammar.accept_tokens([2 + ord('"')])  # MERGED's bytes start at id 2
    ids = allowed(grammar, MERGED)
    assert ids and max(ids) < len(MERGED.token_bytes) and 1 not in ids and 0 not in ids


def test_llguidance_survives_a_refused_token():
    # llguidance's matcher stays in an error state after consuming a token it refuses
    grammar = LlguidanceBackend(TINY).compile(StructuredOutputSpec("regex", "ab"))
    assert not grammar.accept_tokens([ord("a"), ord("x")])
    assert grammar.accept_tokens([ord("a"), ord("b"), 257]) and grammar.is_terminated()


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_choices_with_regex_metacharacters_match_literally(cls):
    choices = ("1+1", "(x)", "a.b", "[?]")
    backend = cls(TINY)
    for choice in choices:
        assert backend.compile(StructuredOutputSpec("choice", choices)).accept_tokens([*choice.encode(), 257])
    assert not backend.compile(StructuredOutputSpec("choice", choices)).accept_tokens(list(b"axb"))
    assert choice_regex(["a.b"]) == "(a\\.b)"


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_a_backend_takes_no_options(cls):
    from kvforge.core import ConfigError

    with pytest.raises(ConfigError, match="takes no options"):
        cls(TINY, any_whitespace=False)


@pytest.mark.parametrize("cls, build", [(XgrammarBackend, "_compile"), (LlguidanceBackend, "_matcher"),
                                        (OutlinesBackend, "_index")], ids=lambda value: getattr(value, "name", ""))
def test_a_spec_compiles_once_and_each_compile_gives_a_fresh_grammar(cls, build, monkeypatch):
    backend = cls(TINY)
    calls = []
    real = getattr(backend, build)
    monkeypatch.setattr(backend, build, lambda spec: calls.append(spec) or real(spec))
    spec = StructuredOutputSpec("regex", "ab")
    first, second = backend.compile(spec), backend.compile(spec)
    assert len(calls) == 1
    assert first.accept_tokens([ord("a")]) and allowed(second, TINY) == [ord("a")]  # independent states


def test_the_spec_cache_drops_the_least_recently_used_spec():
    from kvforge.plugins.structured_output.tracked_grammar import SpecCache

    cache, built = SpecCache(size=2), []
    specs = [StructuredOutputSpec("regex", r) for r in ("a", "b", "c")]
    for spec in [specs[0], specs[1], specs[0], specs[2], specs[0], specs[1]]:
        cache.get(spec, lambda s: built.append(s.value) or s.value)
    assert built == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_json_allows_whitespace_between_tokens_only_when_asked(cls):
    """Compact by default, so a small model cannot spend its tokens on spaces; `any_whitespace` lets them in."""
    if not cls.availability().ok:
        pytest.skip(cls.availability().reason)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
                         "required": ["a"]})
    backend = cls(TINY)
    for any_whitespace in (False, True):
        grammar = backend.compile(StructuredOutputSpec("json", schema, any_whitespace=any_whitespace))
        assert grammar.accept_tokens(list(b'{"a":[1,'))
        assert (ord(" ") in allowed(grammar, TINY)) == any_whitespace


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.name)
def test_mask_and_validate_tokens_agree_on_every_token_where_compact_json_forces_bytes(cls):
    """Compact JSON forces a key's closing quote and its ":"; llguidance's mask then allows only
    the token that spells them (`":`), and its acceptance must refuse `"` alone as well."""
    if not cls.availability().ok:
        pytest.skip(cls.availability().reason)
    schema = json.dumps({"type": "object", "properties": {"p0": {"type": "string"}, "p1": {"type": "integer"}},
                         "required": ["p0", "p1"]})
    grammar = cls(MERGED).compile(StructuredOutputSpec("json", schema))
    for _ in range(12):
        mask = set(allowed(grammar, MERGED))
        disagree = [t for t in range(len(MERGED.token_bytes)) if (grammar.validate_tokens([t]) == 1) != (t in mask)]
        assert not disagree, [MERGED.token_bytes[t] for t in disagree]
        assert grammar.accept_tokens([max(mask - set(MERGED.eos_token_ids))])
