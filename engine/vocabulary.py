"""The model's tokens as grammars see them: core's `Vocabulary` from the engine's
tokenizer, the exact bytes each token id adds to the text.

Three ways tokenizers write a token's bytes: kvforge's byte tokenizer (id = byte);
byte-level BPE (GPT-2, Llama 3, Qwen), whose token strings spell each byte as one
printable character (GPT-2's `bytes_to_unicode` table); and sentencepiece (Llama 2,
Mistral), where '▁' is a space and `<0xNN>` is the raw byte NN. Special tokens add
no text (b"").
"""

from __future__ import annotations

import functools
import json

from kvforge.core.structured_output import Vocabulary

SENTENCEPIECE_SPACE = "\u2581"


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, reversed: character to byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in chars.items()}


def vocabulary_of(tokenizer, vocab_size: int, eos_token_id: int | None) -> Vocabulary:
    """The vocabulary of `tokenizer` (kvforge's `ByteTokenizer` or a transformers
    tokenizer) for a model whose logits are `vocab_size` wide."""
    eos = () if eos_token_id is None else (int(eos_token_id),)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        token_bytes, special = _hf_token_bytes(tokenizer)
    else:
        token_bytes, special = _byte_tokenizer_bytes(tokenizer)
    token_bytes = token_bytes[:vocab_size]
    special = frozenset(i for i in special if i < len(token_bytes)) | frozenset(e for e in eos if e < len(token_bytes))
    return Vocabulary(tuple(token_bytes), eos, vocab_size, special)


def _byte_tokenizer_bytes(tokenizer) -> tuple[list[bytes], set[int]]:
    size = int(tokenizer.vocab_size)
    return [bytes([i]) if i < 256 else b"" for i in range(size)], set(range(256, size))


def _hf_token_bytes(tokenizer) -> tuple[list[bytes], set[int]]:
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, token in added.items() if getattr(token, "special", False)}
    spell = _speller(tokenizer, tokens)
    token_bytes = []
    for i, token in enumerate(tokens):
        if i in special or token is None:
            token_bytes.append(b"")
        elif i in added:  # added tokens are written as plain text
            token_bytes.append(str(added[i]).encode("utf-8"))
        else:
            token_bytes.append(spell(token))
    return token_bytes, special


def _speller(tokenizer, tokens: list) -> callable:
    """How this tokenizer's token strings map to bytes."""
    kind = _decoder_kind(tokenizer, tokens)
    if kind == "byte_level":
        table = byte_level_decoder()
        return lambda token: bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
    if kind == "sentencepiece":
        def spell(token: str) -> bytes:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")
        return spell
    return lambda token: token.encode("utf-8")


def _decoder_kind(tokenizer, tokens: list) -> str:
    """"byte_level", "sentencepiece" or "plain", read from the fast tokenizer's decoder,
    else guessed from the token strings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        text = json.dumps(json.loads(backend.to_str()).get("decoder"))
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"ByteFallback"' in text or '"Metaspace"' in text or SENTENCEPIECE_SPACE in text:
            return "sentencepiece"
    strings = [t for t in tokens if isinstance(t, str)]
    if any(t.startswith(SENTENCEPIECE_SPACE) for t in strings):
        return "sentencepiece"
    if any("\u0120" in t for t in strings):  # 'Ġ', GPT-2's space
        return "byte_level"
    return "plain"
