"""Tensor and pipeline parallelism together (TP=2 x PP=2: four processes on CPU with
gloo), and the vocabulary-parallel embedding and head end to end: the same greedy
tokens and logprobs as one process, each rank holding its share of the weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).parent))  # the shared runs sit beside this file
from parallel_runs import assert_same, llama_dir, run  # noqa: E402

pytest.importorskip("transformers")
TP2_PP2 = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
TINY_EMBEDDING = 259 * 256 * 4  # kvforge-tiny: tied, 259 tokens of 256 float32


@pytest.mark.slow
def test_tiny_model_over_two_stages_of_two_ranks_gives_the_same_greedy_tokens():
    one, [(weights, kv)] = run("kvforge-tiny")
    four, memory = run("kvforge-tiny", TP2_PP2)
    assert_same(four, one)
    assert len(memory) == 4
    # 3 layers: 2 on stage 0 (ranks 0, 1), 1 on stage 1 (ranks 2, 3); 4 KV heads, 2 per rank
    assert [rank_kv for _, rank_kv in memory] == [kv // 3, kv // 3, kv // 6, kv // 6]
    stage0, stage1 = memory[0][0], memory[2][0]
    assert memory[1][0] == stage0 and memory[3][0] == stage1  # the two ranks of a stage hold equal shares
    # stage 0: its layers' halves plus half the (tied) vocabulary rows; stage 1 holds no embedding
    assert stage0 + stage1 < weights / 2 + 64 * 1024
    assert stage1 < (weights - TINY_EMBEDDING) / 3 / 2 + 16 * 1024


@pytest.mark.slow
def test_gqa_llama_over_two_stages_of_two_ranks_with_a_replicated_head(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=2)
    one, _ = run(model)
    four, memory = run(model, {**TP2_PP2, "vocab_parallel": False})
    assert_same(four, one)
    # stage 0: both ranks hold the embedding whole, only rank 0 (which samples) the untied head
    assert memory[0][0] - memory[1][0] == 128 * 64 * 4


@pytest.mark.slow
def test_the_head_split_by_vocabulary_halves_embedding_and_head_per_rank(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=2)  # untied: embedding and head 128 x 64 float32 each
    one, _ = run(model)
    split, split_memory = run(model, {"tensor_parallel_size": 2})
    whole, whole_memory = run(model, {"tensor_parallel_size": 2, "vocab_parallel": False})
    assert_same(split, one)
    assert_same(whole, one)
    table = 128 * 64 * 4
    assert split_memory[0][0] == split_memory[1][0]  # each: half the embedding, half the head
    assert whole_memory[0][0] - split_memory[0][0] == table  # rank 0: both whole instead of halves
    assert whole_memory[1][0] == split_memory[1][0]  # rank 1: the embedding whole, no head: the same bytes


def test_the_verbose_generate_line_names_both_splits():
    from types import SimpleNamespace

    import torch

    from kvforge.cli_generate import selection_line
    from kvforge.core import EngineConfig

    engine = SimpleNamespace(selected={}, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                             kv=SimpleNamespace(block_size=16), config=EngineConfig(parallel=TP2_PP2))
    line = selection_line(engine, verbose=True)
    assert line.endswith("8 KV blocks of 16 tokens per rank; tensor parallel over 2 ranks x pipeline parallel over "
                         "2 stages")
