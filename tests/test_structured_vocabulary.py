"""`vocabulary_of`: the bytes each token id adds, for kvforge's byte tokenizer, a
GPT-2-style byte-level BPE and a sentencepiece-style BPE with byte fallback (both
built offline): joining the bytes of a text's tokens gives back the text's UTF-8."""

from __future__ import annotations

import pytest

from kvforge.engine.vocabulary import vocabulary_of
from kvforge.models.tokenizer import ByteTokenizer

TEXTS = ["Grüße, ça va? Ünïcödé € 😀 and plain words", "  two spaces\tand a tab\nnew line", "{\"a\": [1, 2.5e-3]}"]


def test_byte_tokenizer_tokens_are_their_bytes_and_special_tokens_add_nothing():
    tokenizer = ByteTokenizer()
    vocabulary = vocabulary_of(tokenizer, vocab_size=320, eos_token_id=tokenizer.eos_token_id)
    assert vocabulary.token_bytes[:256] == tuple(bytes([i]) for i in range(256))
    assert vocabulary.token_bytes[256:] == (b"", b"", b"")  # bos, eos, pad
    assert vocabulary.eos_token_ids == (257,) and vocabulary.vocab_size == 320 and vocabulary.bitmask_words == 10
    assert vocabulary.special_token_ids == {256, 257, 258}


transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def gpt2_style():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXTS * 20, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def sentencepiece_style():
    """Llama-2-like: '▁' for spaces, <0xNN> tokens for bytes no piece covers."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "n", "d", "▁a", "▁an", "▁and", "w", "o", "r", "s", "▁w", "▁wo", "t", "e", "x"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁a", "n"), ("▁an", "d"), ("▁", "w"), ("▁w", "o")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


@pytest.mark.parametrize("build", [gpt2_style, sentencepiece_style])
def test_the_bytes_of_a_texts_tokens_join_to_its_utf8(build):
    tokenizer = build()
    vocabulary = vocabulary_of(tokenizer, vocab_size=len(tokenizer) + 5, eos_token_id=tokenizer.eos_token_id)
    assert len(vocabulary.token_bytes) == len(tokenizer) and vocabulary.vocab_size == len(tokenizer) + 5
    for text in TEXTS + ["and words and text"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(vocabulary.token_bytes[i] for i in ids)
        prefix = b" " if build is sentencepiece_style else b""  # sentencepiece writes the leading '▁' as a space
        assert joined == prefix + text.encode("utf-8")
    for special in tokenizer.all_special_ids:
        assert vocabulary.token_bytes[special] == b"" and special in vocabulary.special_token_ids
    assert vocabulary.eos_token_ids == (tokenizer.eos_token_id,)


def test_sentencepiece_byte_fallback_tokens_are_single_bytes():
    tokenizer = sentencepiece_style()
    vocabulary = vocabulary_of(tokenizer, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert vocabulary.token_bytes[tokenizer.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert vocabulary.token_bytes[tokenizer.convert_tokens_to_ids("▁and")] == b" and"
