"""`outlines`: regexes and JSON schemas through outlines-core's public API (a JSON
schema becomes a regex with `json_schema.build_regex_from_schema`; an `Index` is
the regex's automaton over the vocabulary). The grammar walks the index itself,
keeping one state per accepted token, so rolling back is popping states."""

from __future__ import annotations

import json

import torch

from kvforge.core import (
    Grammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    Vocabulary,
    hookimpl,
)
from kvforge.core.structured_output import CHOICE, JSON, REGEX

from .tracked_grammar import SpecCache, TrackedGrammar, choice_regex, json_schema_text, library_availability


UNENFORCED_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
"""JSON-schema keywords outlines-core's regexes leave out: a schema with one is refused, not loosened."""


def unenforced(schema) -> list[str]:
    """What of `schema` outlines-core would not enforce (or cannot build), each said once."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            found.update(f"'{key}'" for key in UNENFORCED_KEYWORDS if key in node)
            if node.get("additionalProperties") is False and not node.get("properties"):
                found.add("'additionalProperties': false on an object without 'properties'")
            for key, value in node.items():
                if key not in ("enum", "const", "default", "examples"):
                    visit(value)

    visit(schema)
    return sorted(found)


class OutlinesGrammar(TrackedGrammar):
    def __init__(self, vocabulary: Vocabulary, index, library_eos: int):
        super().__init__(vocabulary)
        self.index = index
        self._library_eos = library_eos
        self._states = [index.get_initial_state()]

    def _advance(self, token_id: int) -> bool:
        state = self._states[-1]
        if token_id == self._library_eos:
            return False
        following = self.index.get_next_state(state, token_id)
        if following is None:
            return False
        self._states.append(following)
        return True

    def _undo(self, num_tokens: int) -> None:
        del self._states[-num_tokens:]

    def _complete(self) -> bool:
        return self.index.is_final_state(self._states[-1])

    def _fill_library(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = self.index.get_allowed_tokens(self._states[-1]) or []
        ids = torch.tensor([i for i in allowed if i != self._library_eos], dtype=torch.long)
        bits = torch.zeros(bitmask.shape[-1] * 32, dtype=torch.bool)
        bits[ids] = True
        weights = torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)
        words = (bits.view(-1, 32).long() * weights).sum(-1)
        bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class OutlinesBackend(StructuredOutputBackend):
    """Regexes, choices and JSON schemas (as outlines-core writes them as regexes:
    recursion unrolled to a fixed depth; numeric bounds are refused, since its
    regexes leave them out). Not `json_object`: any JSON object is an automaton
    that takes seconds to build."""

    name = "outlines"
    priority = 10
    spec_kinds = frozenset({JSON, REGEX, CHOICE})

    @classmethod
    def spec_unsupported_reasons(cls, spec: StructuredOutputSpec) -> list[str]:
        reasons = super().spec_unsupported_reasons(spec)
        if reasons or spec.kind != JSON:
            return reasons
        try:
            schema = json.loads(spec.value)
        except (TypeError, ValueError):
            return []  # compile says what is wrong with it
        missing = unenforced(schema)
        return [f"outlines does not enforce {', '.join(missing)} in JSON schemas (xgrammar and llguidance do)"] \
            if missing else []

    @classmethod
    def availability(cls):
        return library_availability("outlines_core")

    def __init__(self, vocabulary: Vocabulary, **options):
        super().__init__(vocabulary, **options)
        import outlines_core

        self._oc = outlines_core
        # outlines-core's vocabulary holds one EOS and no special tokens; kvforge's
        # grammar allows every EOS id itself, so one id past the real tokens stands in
        self._library_eos = vocabulary.eos_token_ids[0] if vocabulary.eos_token_ids else len(vocabulary.token_bytes)
        ids_of: dict[bytes, list[int]] = {}
        for i, token in enumerate(vocabulary.token_bytes):
            if token and i not in vocabulary.special_token_ids and i not in vocabulary.eos_token_ids:
                ids_of.setdefault(token, []).append(i)
        self.library_vocabulary = outlines_core.Vocabulary(self._library_eos, ids_of)
        self._indexes = SpecCache()

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        reasons = self.spec_unsupported_reasons(spec)
        if reasons:
            raise StructuredOutputError("; ".join(reasons))
        return OutlinesGrammar(self.vocabulary, self._indexes.get(spec, self._index), self._library_eos)

    def _index(self, spec: StructuredOutputSpec):
        try:
            if spec.kind == JSON:
                # outlines-core's own pattern when whitespace is allowed: at most one space
                whitespace = None if spec.any_whitespace else ""
                regex = self._oc.json_schema.build_regex_from_schema(json_schema_text(spec), whitespace)
            else:
                regex = spec.value if spec.kind == REGEX else choice_regex(spec.value)
            return self._oc.Index(regex, self.library_vocabulary)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise StructuredOutputError(f"invalid {spec.describe()} spec for outlines: {exc}") from exc


@hookimpl
def kvforge_implementations():
    return [OutlinesBackend]
