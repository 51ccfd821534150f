"""Planted structured_output backends: `ChoiceTrie`, a simple correct backend for
`choice` specs, and mutants of it (and of xgrammar) with one bug each, the bug in
its docstring."""

from __future__ import annotations

import dataclasses
import json

from kvforge.core import Grammar, StructuredOutputBackend
from kvforge.core.structured_output import CHOICE, JSON, JSON_OBJECT
from kvforge.plugins.structured_output.xgrammar_backend import XgrammarBackend


def write_bits(bitmask, row: int, token_ids: list[int]) -> None:
    """Row `row` of `bitmask` allows exactly `token_ids` (those inside it)."""
    bitmask[row] = 0
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < bitmask.shape[-1]:
            value = (int(bitmask[row, word]) | (1 << bit)) & 0xFFFFFFFF
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class TrieGrammar(Grammar):
    """The output so far is one byte string; a token is allowed when the bytes it adds
    keep it a prefix of some choice, EOS when it is a whole choice."""

    def __init__(self, backend: "ChoiceTrie", choices: tuple[bytes, ...]):
        self.backend, self.choices = backend, choices
        self.vocabulary = backend.vocabulary
        self.outputs = [b""]  # the output after each accepted token; None after EOS

    def ends(self) -> bool:
        return self.outputs[-1] in self.choices

    def allows(self, token_id: int) -> bool:
        out = self.outputs[-1]
        if out is None or not 0 <= token_id < len(self.vocabulary.token_bytes):
            return False
        if token_id in self.vocabulary.eos_token_ids:
            return self.ends()
        piece = self.vocabulary.token_bytes[token_id]
        return bool(piece) and token_id not in self.vocabulary.special_token_ids and \
            any(choice.startswith(out + piece) for choice in self.choices)

    def accept_tokens(self, token_ids):
        for done, token_id in enumerate(token_ids):
            if not self.allows(token_id):
                self.rollback(done)
                return False
            eos = token_id in self.vocabulary.eos_token_ids
            self.outputs.append(None if eos else self.outputs[-1] + self.vocabulary.token_bytes[token_id])
        return True

    def validate_tokens(self, token_ids):
        accepted = 0
        for token_id in token_ids:
            if not self.accept_tokens([token_id]):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens):
        if num_tokens:
            del self.outputs[-num_tokens:]

    def allowed(self) -> list[int]:
        return [i for i in range(len(self.vocabulary.token_bytes)) if self.allows(i)]

    def fill_bitmask(self, bitmask, row):
        write_bits(bitmask, row, self.allowed())

    def is_terminated(self):
        return self.outputs[-1] is None


class ChoiceTrie(StructuredOutputBackend):
    """Compiles `choice` specs; correct."""

    name = "planted-choice-trie"
    spec_kinds = frozenset({CHOICE})
    grammar_cls = TrieGrammar

    def compile(self, spec):
        return self.grammar_cls(self, tuple(choice.encode() for choice in spec.value))


class OffByOneGrammar(TrieGrammar):
    def fill_bitmask(self, bitmask, row):
        write_bits(bitmask, row, [token_id + 1 for token_id in self.allowed()])


class MaskOffByOneBit(ChoiceTrie):
    """Sets the bit after each allowed token's own: every token of the mask is off by one."""

    name = "mask-off-by-one-bit"
    grammar_cls = OffByOneGrammar


class EarlyEosGrammar(TrieGrammar):
    def ends(self) -> bool:
        out = self.outputs[-1]
        return out is not None and any(len(c) - len(out) <= 1 and c.startswith(out) for c in self.choices)


class EosOneTokenEarly(ChoiceTrie):
    """Allows EOS one byte before a choice is complete."""

    name = "eos-one-token-early"
    grammar_cls = EarlyEosGrammar


class ForgetfulGrammar(TrieGrammar):
    def rollback(self, num_tokens):
        super().rollback(num_tokens - 1 if num_tokens > 1 else num_tokens)


class RollbackForgetsOneToken(ChoiceTrie):
    """Rolls back one token fewer than asked when asked for more than one."""

    name = "rollback-forgets-one-token"
    grammar_cls = ForgetfulGrammar


class NoEosGrammar(TrieGrammar):
    def ends(self) -> bool:
        return False


class EosNeverAllowed(ChoiceTrie):
    """Never allows EOS, so no output can end."""

    name = "eos-never-allowed"
    grammar_cls = NoEosGrammar


def _open(schema):
    """The schema with every `additionalProperties: false` dropped."""
    if isinstance(schema, dict):
        return {k: _open(v) for k, v in schema.items() if not (k == "additionalProperties" and v is False)}
    return [_open(item) for item in schema] if isinstance(schema, list) else schema


class IgnoresAdditionalPropertiesFalse(XgrammarBackend):
    """xgrammar compiling JSON schemas as if `additionalProperties: false` were absent
    (and with xgrammar's strict mode, which closes objects by default, off)."""

    name = "ignores-additional-properties-false"

    def _compile(self, spec):
        if spec.kind != JSON:
            return super()._compile(spec)
        return self.compiler.compile_json_schema(json.dumps(_open(json.loads(spec.value))), strict_mode=False,
                                                 any_whitespace=spec.any_whitespace,
                                                 separators=None if spec.any_whitespace else (",", ":"))


class IgnoresCompactWhitespace(XgrammarBackend):
    """xgrammar compiling every JSON spec as if `any_whitespace` were True: compact
    specs let whitespace in between JSON tokens."""

    name = "ignores-compact-whitespace"

    def _compile(self, spec):
        if spec.kind in (JSON, JSON_OBJECT):
            spec = dataclasses.replace(spec, any_whitespace=True)
        return super()._compile(spec)


PLANTED = [MaskOffByOneBit, EosOneTokenEarly, RollbackForgetsOneToken, EosNeverAllowed,
           IgnoresAdditionalPropertiesFalse, IgnoresCompactWhitespace]
