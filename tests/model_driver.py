"""Test helpers for running models: the paged driver (now `kvforge.models.paged_driver`)
and which attention backends and block sizes a test can run here."""

from __future__ import annotations

import torch

from kvforge.core import build_registry
from kvforge.core.api import ATTENTION_BACKEND
from kvforge.models.paged_driver import PagedDriver  # noqa: F401 (re-exported for the tests)


def cpu_backends(dtype: torch.dtype = torch.float32) -> list:
    """Every registered attention backend that runs here on CPU in `dtype`."""
    found = []
    for registration in build_registry().implementations(ATTENTION_BACKEND):
        cls = registration.cls
        if registration.availability().ok and "cpu" in cls.devices and dtype in cls.dtypes:
            found.append(cls)
    return found


def block_sizes_for(backend, wanted=(1, 16, 32)) -> list[int]:
    """The block sizes of `wanted` that `backend` declares."""
    return [size for size in wanted if backend.block_sizes is None or size in backend.block_sizes]


def save_llama(path, tied: bool):
    """A two-layer GQA Llama (vocabulary 64, hidden 32) with seeded random weights, saved under `path`."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_bench_llama(path, *, vocab: int, hidden: int, positions: int):
    """A one-layer GQA Llama with seeded random weights and the bench's special ids (bos 1,
    eos 2, pad 0), saved under `path`: the smallest model a `kvforge bench` run accepts."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=positions, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)
