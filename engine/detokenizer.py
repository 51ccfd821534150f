"""Incremental detokenization: each step decodes a few tokens, not the whole output.

Decoding a window of tokens on its own can differ from decoding them in context
(a byte-level tokenizer splits UTF-8 sequences across tokens; sentencepiece
drops a leading space at the start of a decode). So each step decodes the
window from `prefix` (some already-emitted context) with and without the new
tokens and keeps the difference; new text is held back while it ends in a
partial character (U+FFFD) and flushed when the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens before this are settled: their text is final
        self.emitted = 0  # characters emitted past the settled text
        self.text = ""

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Bring `text` up to `token_ids` (the output so far); returns the new text."""
        if len(token_ids) <= self.read:
            return ""
        context = self.tokenizer.decode(token_ids[self.prefix:self.read])
        fresh = self.tokenizer.decode(token_ids[self.prefix:])[len(context):]
        partial = fresh.endswith(REPLACEMENT) and not final
        printable = fresh.rstrip(REPLACEMENT) if partial else fresh
        new = printable[self.emitted:]
        self.text += new
        if partial:
            self.emitted = max(self.emitted, len(printable))
        else:
            self.prefix, self.read, self.emitted = self.read, len(token_ids), 0
        return new
