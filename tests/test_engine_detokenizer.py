"""Incremental detokenization equals decoding the whole output at once."""

import random

import pytest

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.models import ByteTokenizer


@pytest.mark.parametrize("seed", range(5))
def test_pieces_add_up_to_the_full_decode_and_never_split_a_character(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "é", "€", "😀", " ", "ß", "\n"]) for _ in range(60))
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == detok.text == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_broken_utf8_is_flushed_when_final():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab") + [0xE2, 0x82]  # the first two bytes of "€"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids) == "ab"  # the partial character is held back
    assert detok.update(ids, final=True) == "\ufffd"
    assert detok.text == tokenizer.decode(ids)
