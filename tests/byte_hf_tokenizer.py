"""kvforge-tiny's byte tokenizer as a transformers tokenizer directory, for tools that
load a tokenizer with `AutoTokenizer.from_pretrained` (lm_eval's `local-completions`):
ids 0..255 are the UTF-8 bytes, then <bos>, <eos>, <pad>, exactly as `ByteTokenizer`."""

from __future__ import annotations

from pathlib import Path


def byte_characters() -> list[str]:
    """The printable character standing for each byte in a byte-level BPE vocabulary
    (the GPT-2 table that `tokenizers`' ByteLevel pre-tokenizer maps bytes through)."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def save_byte_tokenizer(directory: Path, bos: int = 256, eos: int = 257, pad: int = 258) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(byte_characters())}
    vocab.update({"<bos>": bos, "<eos>": eos, "<pad>": pad})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(directory))
    return directory
