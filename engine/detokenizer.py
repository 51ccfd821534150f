"""Incremental detokenization: each step decodes a few tokens, not the whole output.

Decoding a window of tokens on its own can differ from decoding them in context
(a byte-level tokenizer splits UTF-8 sequences across tokens; sentencepiece
drops a leading space at the start of a decode). So each step decodes the
window from `prefix` (some already-emitted context) with and without the new
tokens and keeps the difference; new text is held back while it ends in a
partial character (U+FFFD) and flushed when the request finishes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def plain_decode(tokenizer) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode`, or the same text with less Python around it: for a
    transformers tokenizer whose `decode` is only its `tokenizers` backend's
    decode (neither method overridden, no clean-up of spaces), the backend's own
    `decode`, without transformers' per-call argument handling (each step makes
    two calls per request; docs/benchmarks.md has the time saved)."""
    if "transformers" not in sys.modules:  # then the tokenizer is not one of its own (and none is imported here)
        return tokenizer.decode
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode as it is
        return tokenizer.decode
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode
            or kind._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return tokenizer.decode
    backend = tokenizer.backend_tokenizer
    return lambda ids: backend.decode(list(ids), skip_special_tokens=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.decode = plain_decode(tokenizer)
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens before this are settled: their text is final
        self.emitted = 0  # characters emitted past the settled text
        self.text = ""

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Bring `text` up to `token_ids` (the output so far); returns the new text."""
        if len(token_ids) <= self.read:
            return ""
        context = self.decode(token_ids[self.prefix:self.read])
        fresh = self.decode(token_ids[self.prefix:])[len(context):]
        partial = fresh.endswith(REPLACEMENT) and not final
        printable = fresh.rstrip(REPLACEMENT) if partial else fresh
        new = printable[self.emitted:]
        self.text += new
        if partial:
            self.emitted = max(self.emitted, len(printable))
        else:
            self.prefix, self.read, self.emitted = self.read, len(token_ids), 0
        return new
