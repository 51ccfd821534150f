"""`xgrammar`: the default structured_output backend, through xgrammar's public API
(`TokenizerInfo`, a thread-safe `GrammarCompiler`, `GrammarMatcher`, and its
CPU kernel for applying the bitmask)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvforge.core import (
    Grammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    Vocabulary,
    apply_token_bitmask,
    hookimpl,
)
from kvforge.core.structured_output import CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX, STRUCTURAL_TAG

from .bitmask_apply import apply_bitmask_fastest
from .tracked_grammar import (
    COMPACT_SEPARATORS,
    SpecCache,
    TrackedGrammar,
    choice_regex,
    json_schema_text,
    library_availability,
)

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# xgrammar writes the characters of a length-bounded JSON string as this class, which
# lets raw control characters through (JSON forbids them, json.loads refuses them);
# its unbounded strings use the second, right one
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def library_message(exc: Exception) -> str:
    """xgrammar's error without its C++ log prefix (time, source file, failed check), first line only."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


class XgrammarGrammar(TrackedGrammar):
    def __init__(self, vocabulary: Vocabulary, matcher):
        super().__init__(vocabulary)
        self.matcher = matcher

    def _advance(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)  # False leaves the matcher as it was

    def _undo(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def _complete(self) -> bool:
        return self.matcher.is_completed()

    def _fill_library(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend(StructuredOutputBackend):
    """JSON schemas, any JSON object, regexes, choices, EBNF grammars (xgrammar's
    GBNF dialect) and xgrammar's structural tags."""

    name = "xgrammar"
    priority = 30
    spec_kinds = frozenset({JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG})
    grammar_syntaxes = frozenset({"ebnf"})

    @classmethod
    def availability(cls):
        return library_availability("xgrammar")

    def __init__(self, vocabulary: Vocabulary, **options):
        super().__init__(vocabulary, **options)
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo(list(vocabulary.token_bytes), xgrammar.VocabType.RAW,
                                      vocab_size=vocabulary.vocab_size,
                                      stop_token_ids=list(vocabulary.eos_token_ids) or None)
        # one bounded cache by spec here, rather than xgrammar's own, which grows without limit
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._compiled = SpecCache()

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        reasons = self.spec_unsupported_reasons(spec)
        if reasons:
            raise StructuredOutputError("; ".join(reasons))
        compiled = self._compiled.get(spec, self._compile_checked)
        return XgrammarGrammar(self.vocabulary, self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=False))

    def _compile_checked(self, spec: StructuredOutputSpec):
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports a bad spec as one of these
            raise StructuredOutputError(f"invalid {spec.describe()} spec for xgrammar: {library_message(exc)}") from exc

    def _compile(self, spec: StructuredOutputSpec):
        if spec.kind in (JSON, JSON_OBJECT):
            layout = {} if spec.any_whitespace else {"any_whitespace": False, "separators": COMPACT_SEPARATORS}
            grammar = str(self._xgr.Grammar.from_json_schema(json_schema_text(spec), **layout))
            return self.compiler.compile_grammar(grammar.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        if spec.kind == REGEX:
            return self.compiler.compile_regex(spec.value)
        if spec.kind == CHOICE:
            return self.compiler.compile_regex(choice_regex(spec.value))
        if spec.kind == GRAMMAR:
            return self.compiler.compile_grammar(spec.value)
        return self.compiler.compile_structural_tag(spec.value)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """For CPU logits of a float dtype xgrammar has a kernel for: its kernel or
        a torch op, whichever is faster for this mask (bitmask_apply.py); the
        reference otherwise."""
        if logits.device.type != "cpu" or logits.dtype not in KERNEL_DTYPES or logits.dim() != 2 \
                or logits.shape[-1] > bitmask.shape[-1] * 32 or not logits.is_contiguous():
            apply_token_bitmask(logits, bitmask, rows)
            return
        apply_bitmask_fastest(logits, bitmask, rows, self._kernel)

    def _kernel(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None) -> None:
        """xgrammar's CPU kernel. It indexes bitmask and logits by the same rows, so a
        subset of rows is spread out to the logits' rows first."""
        if rows is not None:
            rows = list(rows)
            spread = torch.full((logits.shape[0], bitmask.shape[-1]), -1, dtype=torch.int32)
            spread[rows] = bitmask
            bitmask = spread
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=logits.shape[-1],
                                              indices=rows, backend="cpu")


@hookimpl
def kvforge_implementations():
    return [XgrammarBackend]
