"""Greedy output of the engine equals transformers' `generate` (each prompt alone),
with a KV cache small enough that requests are preempted and long prompts are
prefilled in chunks, whatever max_num_seqs, block size and CPU backend."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.core import ATTENTION_BACKEND, SelectionRequest, build_registry, cdiv

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
BUDGET = 16  # tokens per step: every prompt longer than this is chunked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random Llama (GQA) saved as a Hugging Face directory, its reference
    greedy outputs, and the prompts."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.choice([1, 3, 9, 17, 30, 41]))] for _ in range(32)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
            top2 = torch.stack(out.scores).squeeze(1).topk(2).values
            # A near-tie would make the comparison depend on rounding, not on correctness.
            assert bool(((top2[:, 0] - top2[:, 1]) > 1e-4).all()), "pick another seed: greedy near-tie"
            expected.append(out.sequences[0, len(prompt):].tolist())
    return path, prompts, expected


def cpu_backends() -> list[str]:
    """Every attention backend that can serve this model on this machine's CPU."""
    request = SelectionRequest(device="cpu", dtype=torch.float32, head_size=16, num_heads=4, num_kv_heads=2)
    return [c.registration.name for c in build_registry().candidates(ATTENTION_BACKEND, request) if c.usable]


SHAPES = [(32, 4), (3, 16), (8, 8), (32, 16)]  # (max_num_seqs, block_size)
GRID = [(backend, *shape) for i, backend in enumerate(cpu_backends()) for shape in (SHAPES[i % 2], SHAPES[2 + i % 2])]


def test_at_least_two_cpu_backends_are_compared():
    assert len({backend for backend, _, _ in GRID}) >= 2


@pytest.mark.parametrize("backend, max_num_seqs, block_size", GRID)
def test_greedy_output_matches_transformers_under_preemption_and_chunking(checkpoint, backend, max_num_seqs,
                                                                           block_size):
    path, prompts, expected = checkpoint
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = 3 * cdiv(longest, block_size)  # room for about three requests at once
    llm = LLM(str(path), device="cpu", dtype="float32", attention={"backend": backend},
              cache={"block_size": block_size, "num_blocks": num_blocks},
              scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": BUDGET})
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0,
                                                                                    max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    metrics = llm.engine.metrics()
    if max_num_seqs > 3:
        assert metrics["preemptions"] > 0
    assert max(len(p) for p in prompts) > BUDGET
    assert llm.engine.kv.usage().in_use == 0


def test_sliding_window_model_picks_a_capable_backend_and_matches_transformers(tmp_path):
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=128, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(1)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    prompts = [[(7 * i + j) % 128 for j in range(n)] for i, n in enumerate([5, 12, 20, 27])]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", cache={"block_size": 4, "num_blocks": 24},
              scheduler={"max_num_batched_tokens": 8})
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=6))
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
            assert out.token_ids == expected
