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


transformers = pytest.importorskip("transformers")


def byte_level_bpe(**kwargs):
    """A small byte-level BPE as transformers loads one from tokenizer.json: every
    byte is a token, so random ids split characters across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = "Grüße, ça va? Ünïcödé € 😀 and plain words, again and again. " * 20
    tokenizer.train_from_iterator([text], trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", **kwargs)


def pieces_of(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == detok.text
    return detok.text


@pytest.mark.parametrize("seed", range(4))
def test_a_transformers_tokenizer_decodes_through_its_backend_to_the_same_text(seed):
    from kvforge.engine.detokenizer import plain_decode

    tokenizer = byte_level_bpe()
    assert plain_decode(tokenizer) != tokenizer.decode  # the backend's decode, not transformers' wrapper
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(80)]  # lone bytes of characters among them
    for special in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        ids.insert(rng.randrange(len(ids)), special)  # decoded as text, as transformers' decode does by default
    assert pieces_of(tokenizer, ids) == tokenizer.decode(ids)


def test_a_tokenizer_that_cleans_up_spaces_or_decodes_its_own_way_keeps_its_decode():
    from kvforge.engine.detokenizer import plain_decode

    cleaning = byte_level_bpe(clean_up_tokenization_spaces=True)
    assert plain_decode(cleaning) == cleaning.decode

    class Shouting(transformers.PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    base = byte_level_bpe()
    shouting = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="</s>")
    assert plain_decode(shouting) == shouting.decode
    ids = base.encode("and again, ça va")
    assert pieces_of(shouting, ids) == "AND AGAIN, ÇA VA"


def test_the_engine_streams_the_text_transformers_decodes():
    import sys
    from pathlib import Path

    from kvforge import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
    from engine_fakes import FakeCausalLM, fake_engine

    tokenizer = byte_level_bpe()
    llm = LLM.from_engine(fake_engine(FakeCausalLM(vocab_size=len(tokenizer)), tokenizer=tokenizer))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    pieces = llm.stream(prompt_token_ids=[[5, 9, 2]], sampling_params=params)
    streamed = "".join(piece.outputs[0].new_text for piece in pieces)
    out = llm.generate(prompt_token_ids=[[5, 9, 2]], sampling_params=params)[0]
    assert out.text == streamed == tokenizer.decode(out.token_ids) and len(out.token_ids) == 40
