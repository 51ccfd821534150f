"""Tokenizers: byte-level for the built-in models, transformers' for HF directories.

Token ids in and out always work without a tokenizer; `load_tokenizer` returns
None for a directory that has none.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import tokenizer_choice
from .loader import resolve_model_dir

BYTE_TOKENIZER_FILE = "kvforge_tokenizer.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow (bos, eos, pad by default)."""

    def __init__(self, bos_token_id: int = 256, eos_token_id: int = 257, pad_token_id: int = 258):
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.vocab_size = max(bos_token_id, eos_token_id, pad_token_id) + 1

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`; no special tokens are added."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes back to text; special tokens are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_tokenizer(name_or_path: str | Path):
    """The model's tokenizer: byte-level for the built-ins, the one transformers'
    AutoTokenizer loads when the directory has tokenizer files (`tokenizer_choice`),
    None when it has neither."""
    model_dir = resolve_model_dir(name_or_path)
    byte_file = model_dir / BYTE_TOKENIZER_FILE
    if byte_file.is_file():
        return ByteTokenizer(**json.loads(byte_file.read_text()))
    if any((model_dir / name).is_file() for name in HF_TOKENIZER_FILES):
        return tokenizer_choice.load(model_dir)
    return None
