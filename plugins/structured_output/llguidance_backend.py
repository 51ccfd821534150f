"""`llguidance`: the structured_output backend of guidance, through llguidance's
public API (`LLTokenizer` over a `TokenizerWrapper` of the raw token bytes,
`LLMatcher`, `llguidance.torch.fill_next_token_bitmask`). Its mask application
is a `torch.compile` kernel, so the reference batched mask applies it here."""

from __future__ import annotations

import json

import torch

from kvforge.core import (
    Grammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    Vocabulary,
    cdiv,
    hookimpl,
)
from kvforge.core.structured_output import CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX

from .tracked_grammar import COMPACT_SEPARATORS, SpecCache, TrackedGrammar, json_schema_text, library_availability


class _RawTokens:
    """What `llguidance.TokenizerWrapper` reads: the token bytes, the special ids,
    and an encoder (greedy longest match; llguidance only uses it on forced text)."""

    def __init__(self, vocabulary: Vocabulary):
        self.tokens = list(vocabulary.token_bytes)
        self.eos_token_id = vocabulary.eos_token_ids[0] if vocabulary.eos_token_ids else None
        self.bos_token_id = None
        self.special_token_ids = sorted(vocabulary.special_token_ids | set(vocabulary.eos_token_ids))
        self._by_bytes = {token: i for i, token in enumerate(self.tokens) if token and i not in self.special_token_ids}
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text: bytes) -> list[int]:
        ids, start = [], 0
        while start < len(text):
            for end in range(min(len(text), start + self._longest), start, -1):
                if text[start:end] in self._by_bytes:
                    ids.append(self._by_bytes[text[start:end]])
                    start = end
                    break
            else:  # a byte no token spells: skip it
                start += 1
        return ids


class LlguidanceGrammar(TrackedGrammar):
    def __init__(self, vocabulary: Vocabulary, matcher, words: int):
        super().__init__(vocabulary)
        self.matcher = matcher
        self._words = words  # llguidance writes one bit per tokenizer token, no padding

    def _advance(self, token_id: int) -> bool:
        # a token llguidance consumes and rejects puts it in an error state for good: ask first
        return self.matcher.validate_tokens([token_id]) == 1 and self._masked_in(token_id) \
            and self.matcher.consume_token(token_id)

    def _masked_in(self, token_id: int) -> bool:
        """Where the next bytes are forced (a key and its ":" in compact JSON), llguidance's
        mask allows only the tokens that spell them canonically (`":`, not `"`), though it
        would consume the others: acceptance follows the mask, so the two agree."""
        if not self.matcher.compute_ff_bytes():
            return True
        row = torch.zeros((1, self.vocabulary.bitmask_words), dtype=torch.int32)
        self._fill_library(row, 0)
        word, bit = divmod(token_id, 32)
        return bool((int(row[0, word]) >> bit) & 1)

    def _undo(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def _complete(self) -> bool:
        return self.matcher.is_accepting()

    def _fill_library(self, bitmask: torch.Tensor, row: int) -> None:
        line = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(line.data_ptr(), self._words * 4)
        line[self._words:] = 0


class LlguidanceBackend(StructuredOutputBackend):
    """JSON schemas, any JSON object, regexes, choices and Lark grammars
    (llguidance's dialect, which also embeds JSON schemas and regexes)."""

    name = "llguidance"
    priority = 20
    spec_kinds = frozenset({JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR})
    grammar_syntaxes = frozenset({"lark"})

    @classmethod
    def availability(cls):
        return library_availability("llguidance")

    def __init__(self, vocabulary: Vocabulary, **options):
        super().__init__(vocabulary, **options)
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_RawTokens(vocabulary)))
        self._words = cdiv(len(vocabulary.token_bytes), 32)
        self._templates = SpecCache()

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        reasons = self.spec_unsupported_reasons(spec)
        if reasons:
            raise StructuredOutputError("; ".join(reasons))
        template = self._templates.get(spec, self._matcher)
        return LlguidanceGrammar(self.vocabulary, template.deep_copy(), self._words)

    def _matcher(self, spec: StructuredOutputSpec):
        matcher_cls = self._llg.LLMatcher
        try:
            if spec.kind in (JSON, JSON_OBJECT):
                layout = None if spec.any_whitespace else {
                    "whitespace_flexible": False, "item_separator": COMPACT_SEPARATORS[0],
                    "key_separator": COMPACT_SEPARATORS[1]}
                grammar = matcher_cls.grammar_from_json_schema(json_schema_text(spec), overrides=layout)
            elif spec.kind == REGEX:
                grammar = matcher_cls.grammar_from_regex(spec.value)
            elif spec.kind == CHOICE:
                grammar = matcher_cls.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.value))
            else:
                grammar = matcher_cls.grammar_from_lark(spec.value)
        except (ValueError, TypeError) as exc:
            raise StructuredOutputError(f"invalid {spec.describe()} spec for llguidance: {exc}") from exc
        error = matcher_cls.validate_grammar(grammar, self.tokenizer)
        if error:
            raise StructuredOutputError(f"invalid {spec.describe()} spec for llguidance: {error.strip()}")
        matcher = matcher_cls(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {spec.describe()} spec for llguidance: {matcher.get_error()}")
        return matcher


@hookimpl
def kvforge_implementations():
    return [LlguidanceBackend]
