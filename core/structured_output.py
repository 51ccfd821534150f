"""The `structured_output` interface: grammars that constrain which tokens may come next.

A backend compiles a request's `StructuredOutputSpec` (a JSON schema, a regex, a
list of choices, a grammar) into a `Grammar` over the model's vocabulary. The host
keeps one grammar per sampled sequence beside its position: each step it asks the
grammar for one bitmask row per sampling position, masks the logits with one
batched op, and tells the grammar which tokens were accepted; speculation and
preemption roll the grammar back where they roll back tokens.

The bitmask is the layout xgrammar and llguidance share: `int32`,
`[rows, cdiv(vocab_size, 32)]`; bit `j` of word `i` set means token `32 * i + j`
may come next. Token ids at or past `len(Vocabulary.token_bytes)` (padding the
model's logits carries beyond the tokenizer) are never allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .api import STRUCTURED_OUTPUT
from .errors import StructuredOutputError  # noqa: F401  (raised by implementations; documented here)
from .implementation import Implementation
from .kv_cache import cdiv

JSON = "json"
JSON_OBJECT = "json_object"
REGEX = "regex"
CHOICE = "choice"
GRAMMAR = "grammar"
STRUCTURAL_TAG = "structural_tag"
SPEC_KINDS: tuple[str, ...] = (JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG)
"""Every kind of spec a request may carry; a backend declares the ones it compiles."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What one request's output must match; hashable, so compiled grammars are
    cached by spec.

    `value` by kind: `json` the JSON schema as text, `json_object` None (any JSON
    object), `regex` the pattern, `choice` a tuple of the allowed strings,
    `grammar` the grammar text in `grammar_syntax` (e.g. "ebnf", "lark"),
    `structural_tag` the backend's own structural-tag JSON text.

    `any_whitespace` (read by `json` and `json_object` specs only): False, the
    default, allows no whitespace outside strings (separators "," and ":"), so a
    small model cannot loop on spaces between tokens until `max_tokens`; True
    allows the whitespace the backend's library allows (pretty-printed JSON).
    """

    kind: str
    value: str | tuple[str, ...] | None = None
    grammar_syntax: str | None = None
    any_whitespace: bool = False

    def describe(self) -> str:
        """A short label for messages and metrics (never the whole schema)."""
        if self.kind == GRAMMAR:
            return f"grammar ({self.grammar_syntax or 'unspecified syntax'})"
        return self.kind


@dataclass(frozen=True)
class Vocabulary:
    """The model's tokens as a grammar sees them.

    `token_bytes[i]` is the exact bytes token `i` adds to the text (special tokens:
    b""); `vocab_size` is the width of the model's logits, which may exceed
    `len(token_bytes)`; `eos_token_ids` end a sequence and are allowed by a grammar
    exactly when the output so far is complete.
    """

    token_bytes: tuple[bytes, ...]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def bitmask_words(self) -> int:
        return cdiv(self.vocab_size, 32)


class Grammar(ABC):
    """One sequence's matching state. Guarantees every implementation keeps (the
    conformance suite checks each):

      1. `fill_bitmask` sets exactly the tokens whose acceptance keeps the output
         a prefix of some document the spec allows; an EOS token only when the
         output so far is itself a complete document. Before termination at least
         one bit is set.
      2. `accept_tokens` advances over every token and returns True only if each
         one is allowed in turn; on a rejected token it returns False and the state
         is exactly as before the call.
      3. `validate_tokens` returns how many leading tokens `accept_tokens` would
         accept, without changing the state.
      4. `rollback(n)` undoes the last `n` accepted tokens (an accepted EOS
         included): masks and termination are as they were before them.
      5. `is_terminated()` is True once an EOS token was accepted (and stays so
         until rolled back); a terminated grammar accepts no further token, and
         its mask row allows none (all zeros).
      6. The same state gives the same mask: masks depend only on the tokens
         accepted so far.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids`; False, with nothing changed, if any is not allowed."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """The length of the longest prefix of `token_ids` that would be accepted."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask`
        (int32, `[rows, Vocabulary.bitmask_words]`, on the CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether an EOS token has been accepted."""


class StructuredOutputBackend(Implementation):
    """A grammar library behind the contract: compiles specs into `Grammar`s.

    Guarantees every implementation keeps (the conformance suite checks each):

      1. `compile` returns a grammar for every spec `spec_unsupported_reasons`
         accepts; an invalid spec (a schema, regex or grammar that does not parse)
         raises `StructuredOutputError` naming what is wrong.
      2. Every complete output of a compiled grammar (tokens up to an accepted
         EOS) decodes to text the spec allows: for `json`, a document the schema
         validates (the `jsonschema` package judges); for `choice`, one of the
         choices; for `regex`, a full match. A `json` or `json_object` spec with
         `any_whitespace` False allows no whitespace outside JSON strings.
      3. `compile` is safe to call from several threads at once (the host compiles
         off its step loop); grammars are used from one thread at a time.

    `spec_kinds` lists the `SPEC_KINDS` it compiles and `grammar_syntaxes` the
    syntaxes of its `grammar` specs; `auto` takes the highest-priority available
    backend that supports the request's spec.
    """

    kind: ClassVar[str] = STRUCTURED_OUTPUT
    spec_kinds: ClassVar[frozenset[str]] = frozenset()
    grammar_syntaxes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, vocabulary: Vocabulary, **options: Any):
        """`options` are `structured_outputs.options` from the config; a backend
        names and documents its own, and refuses unknown ones with a ConfigError."""
        if options:
            from .errors import ConfigError

            raise ConfigError(f"structured output backend {self.name!r} takes no options, got {sorted(options)}; "
                              "remove structured_outputs.options")
        self.vocabulary = vocabulary

    @classmethod
    def spec_unsupported_reasons(cls, spec: StructuredOutputSpec) -> list[str]:
        """Why this backend cannot compile `spec` (empty when it can); never raises."""
        if spec.kind not in SPEC_KINDS:
            return [f"unknown spec kind {spec.kind!r}; valid kinds: {', '.join(SPEC_KINDS)}"]
        if spec.kind not in cls.spec_kinds:
            return [f"{cls.name} does not compile {spec.kind!r} specs (it compiles {', '.join(sorted(cls.spec_kinds))})"]
        if spec.kind == GRAMMAR and spec.grammar_syntax not in cls.grammar_syntaxes:
            return [f"{cls.name} does not read {spec.grammar_syntax!r} grammars "
                    f"(it reads {', '.join(sorted(cls.grammar_syntaxes)) or 'none'})"]
        return []

    @classmethod
    def unsupported_reasons(cls, request) -> list[str]:
        spec = getattr(request, "structured_output_spec", None)
        return [] if spec is None else cls.spec_unsupported_reasons(spec)

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"spec_kinds": sorted(cls.spec_kinds), "grammar_syntaxes": sorted(cls.grammar_syntaxes)}

    @abstractmethod
    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        """A fresh grammar for `spec`, at the start of the output."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An all-allowed bitmask of `num_rows` rows (int32, on the CPU)."""
        return torch.full((num_rows, self.vocabulary.bitmask_words), -1, dtype=torch.int32)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Set to -inf, in place, every logit whose bit is clear, over all rows at once.
        `rows` picks the rows of `logits` that `bitmask`'s rows belong to (default:
        all, in order). A backend may override this with its library's kernel."""
        apply_token_bitmask(logits, bitmask, rows)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """The reference batched mask: unpack the int32 words into booleans and fill."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[:, :vocab].to(logits.device)
    if allowed.shape[-1] < vocab:  # logits wider than the mask: the extra ids are never allowed
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[-1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=-1)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
