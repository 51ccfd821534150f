"""Test-local `structured_output` backends: a `choice` trie that keeps the contract
over any vocabulary (what the engine tests run against), one whose compile waits
until released (a compile that hangs), and one whose grammar wrongly allows one
token past the end of a choice (shown caught by the engine). Registered through
`plugin()` like any third-party plugin."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvforge.core import hookimpl
from kvforge.core.structured_output import (
    CHOICE,
    Grammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    Vocabulary,
)


class ChoiceGrammar(Grammar):
    """The output is one of `choices` (bytes); state is the list of accepted tokens."""

    def __init__(self, choices: tuple[bytes, ...], vocabulary: Vocabulary):
        self.choices = choices
        self.vocabulary = vocabulary
        self.eos = set(vocabulary.eos_token_ids)
        self.tokens: list[int] = []
        self.text = b""

    def _allows(self, text: bytes, terminated: bool, token: int) -> tuple[bool, bytes, bool]:
        if terminated or not 0 <= token < len(self.vocabulary.token_bytes):
            return False, text, terminated
        if token in self.eos:
            return text in self.choices, text, True
        piece = self.vocabulary.token_bytes[token]
        if not piece:
            return False, text, terminated
        extended = text + piece
        return any(c.startswith(extended) for c in self.choices), extended, False

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        if self.validate_tokens(token_ids) < len(token_ids):
            return False
        for token in token_ids:
            _, self.text, _ = self._allows(self.text, self.is_terminated(), token)
            self.tokens.append(token)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        text, terminated = self.text, self.is_terminated()
        for i, token in enumerate(token_ids):
            ok, text, terminated = self._allows(text, terminated, token)
            if not ok:
                return i
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        kept = self.tokens[: len(self.tokens) - num_tokens]
        self.tokens, self.text = [], b""
        self.accept_tokens(kept)

    def fill_bitmask(self, bitmask, row: int) -> None:
        words = [0] * bitmask.shape[1]
        terminated = self.is_terminated()
        for token in range(len(self.vocabulary.token_bytes)):
            if self._allows(self.text, terminated, token)[0]:
                words[token // 32] |= 1 << (token % 32)
        for i, word in enumerate(words):
            bitmask[row, i] = word - (1 << 32) if word >= 1 << 31 else word  # as int32

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] in self.eos


class ChoiceTrieBackend(StructuredOutputBackend):
    name = "test-choice-trie"
    priority = 100
    spec_kinds = frozenset({CHOICE})

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        if any(not choice for choice in spec.value):
            raise StructuredOutputError("a choice must not be empty: the output would be only an EOS")
        return ChoiceGrammar(tuple(c.encode("utf-8") for c in spec.value), self.vocabulary)


class HangingChoiceBackend(ChoiceTrieBackend):
    """Compiles a spec whose first choice is "hang" only once `release` is set."""

    name = "test-hanging-choice"
    priority = 0
    release = threading.Event()

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        if spec.value[0] == "hang":
            self.release.wait(timeout=60)
        return super().compile(spec)


class Plugin:
    def __init__(self, *classes):
        self.classes = list(classes)

    @hookimpl
    def kvforge_implementations(self):
        return self.classes


def plugin(*classes) -> Plugin:
    return Plugin(*(classes or (ChoiceTrieBackend, HangingChoiceBackend)))
