"""What the built-in grammar backends share: EOS and termination handled the one
way the contract states them, a bounded cache of compiled forms by spec, the
"not installed" answer, and choices written as a regex.

Each library has its own idea of EOS (xgrammar ends on a stop token it was told
of, llguidance stops by itself when nothing can follow, outlines-core never
advances over EOS at all), so `TrackedGrammar` keeps EOS out of the library: it
is allowed exactly when the library says the output so far is complete, and
accepting it terminates the grammar (guarantees 1 and 5).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch

from kvforge.core import Availability, Grammar, StructuredOutputError, StructuredOutputSpec, Vocabulary

INSTALL_HINT = "pip install 'kvforge[structured]'"
CACHED_SPECS = 64
"""Compiled forms each backend keeps by spec (the host caches whole grammars on top)."""
_REGEX_META = set("\\.+*?()|[]{}^$")
COMPACT_SEPARATORS = (",", ":")
"""Item and key separators of compact JSON (a spec with `any_whitespace` False)."""


def library_availability(module: str) -> Availability:
    """Whether `module` is importable, without importing it."""
    if importlib.util.find_spec(module) is None:
        return Availability.no(f"{module} not installed: {INSTALL_HINT}")
    return Availability.yes()


def choice_regex(choices: Sequence[str]) -> str:
    """A regex that fully matches exactly the given strings, each regex
    metacharacter escaped (the escapes every backend's regex dialect reads)."""
    return "|".join("(" + "".join("\\" + c if c in _REGEX_META else c for c in choice) + ")" for choice in choices)


def json_schema_text(spec: StructuredOutputSpec) -> str:
    """The JSON schema of a `json` or `json_object` spec, as text; refuses text that is not JSON."""
    if spec.value is None:  # json_object: any JSON object
        return '{"type": "object"}'
    try:
        json.loads(spec.value)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputError(f"invalid JSON schema: it is not JSON ({exc}); pass the schema as a JSON "
                                    "object or its JSON text") from exc
    return spec.value


class SpecCache:
    """A thread-safe least-recently-used map from spec to a compiled form."""

    def __init__(self, size: int = CACHED_SPECS):
        self.size = size
        self._items: OrderedDict[StructuredOutputSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: StructuredOutputSpec, build: Callable[[StructuredOutputSpec], Any]) -> Any:
        with self._lock:
            if spec in self._items:
                self._items.move_to_end(spec)
                return self._items[spec]
        value = build(spec)  # outside the lock: compiles run in parallel
        with self._lock:
            self._items[spec] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


def _mask_rows(vocabulary: Vocabulary, eos_ids: Sequence[int]) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Two bitmask rows (int32 words): every token a grammar may ever allow but
    EOS (the tokenizer's tokens, less its special ones), and the EOS bits alone."""
    size = vocabulary.bitmask_words * 32
    possible = torch.zeros(size, dtype=torch.int64)
    possible[:len(vocabulary.token_bytes)] = 1
    possible[sorted(vocabulary.special_token_ids)] = 0
    eos = torch.zeros(size, dtype=torch.int64)
    eos[list(eos_ids)] = 1
    return _pack(possible & (1 - eos)), _pack(eos)


def _pack(bits: torch.Tensor) -> numpy.ndarray:
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).numpy()


class TrackedGrammar(Grammar):
    """A grammar over a library matcher, with EOS and termination kept here.

    Subclasses implement `_advance` (one non-EOS token; False with nothing
    changed if it is not allowed), `_undo` (roll the library back), `_complete`
    (the output so far is a whole document) and `_fill_library` (the library's
    mask for the next non-EOS token).
    """

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self._eos = frozenset(vocabulary.eos_token_ids)
        self._never = vocabulary.special_token_ids - self._eos
        # Two precomputed rows make the per-row work around the library's fill two
        # array ops (a loop over EOS ids here cost more than the library's fill itself);
        # numpy arrays, since a numpy op on one row costs a fraction of a torch op's dispatch
        self._possible, self._eos_words = _mask_rows(
            vocabulary, sorted(i for i in self._eos if i < vocabulary.vocab_size))
        self._num_accepted = 0
        self._terminated = False

    @abstractmethod
    def _advance(self, token_id: int) -> bool: ...

    @abstractmethod
    def _undo(self, num_tokens: int) -> None: ...

    @abstractmethod
    def _complete(self) -> bool: ...

    @abstractmethod
    def _fill_library(self, bitmask: torch.Tensor, row: int) -> None: ...

    def _accept_one(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._eos:
            if not self._complete():
                return False
            self._terminated = True
        elif not (0 <= token_id < len(self.vocabulary.token_bytes)) or token_id in self._never \
                or not self._advance(token_id):
            return False
        self._num_accepted += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for done, token_id in enumerate(token_ids):
            if not self._accept_one(int(token_id)):
                self.rollback(done)
                return False
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        accepted = 0
        for token_id in token_ids:
            if not self._accept_one(int(token_id)):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise StructuredOutputError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} were accepted")
        if num_tokens == 0:
            return
        self._num_accepted -= num_tokens
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._undo(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].zero_()
            return
        self._fill_library(bitmask, row)
        line = bitmask[row].numpy()  # shares the tensor's memory: the ops below write the bitmask
        # libraries differ on padding ids and special tokens: never them; and EOS is ours
        # to allow, exactly when the output is complete
        numpy.bitwise_and(line, self._possible, out=line)
        if self._complete():
            numpy.bitwise_or(line, self._eos_words, out=line)

    def is_terminated(self) -> bool:
        return self._terminated
