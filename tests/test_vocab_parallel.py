"""Vocabulary-parallel embedding and LM head in one process, without workers (float64):
the ranks' slices add up to the whole embedding, their logits side by side are the
whole head's, padding included when the ranks do not divide the vocabulary."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvforge.core import cdiv
from kvforge.distributed import shard_model
from kvforge.distributed.layout import RankLayout
from kvforge.distributed.vocab_parallel import VocabParallelEmbedding, gather_logits, split_vocab, vocab_shard
from kvforge.models import load_model
from kvforge.models.base import ModelConfig
from kvforge.models.llama import LlamaForCausalLM


class Rank:
    """Rank `rank` of `size`; its all-reduce returns its own partial (the test sums them)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.device = rank, size, torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Gathered:
    """An all-gather that hands back slices computed beforehand by every rank."""

    def __init__(self, slices: list[torch.Tensor]):
        self.slices = slices

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.slices


@pytest.fixture(scope="module")
def tiny():
    return load_model("kvforge-tiny", linear_kernel="torch").double()  # tied, 259 tokens: not divisible by 2


def split(model, size, how=shard_model):
    """Every rank's copy of `model`, split by `how` (the whole shard, or only the vocabulary
    for sizes the heads do not divide)."""
    parts = []
    for rank in range(size):
        part = copy.deepcopy(model)
        how(part, Rank(rank, size))
        parts.append(part)
    return parts


@pytest.mark.parametrize("size", [2, 3, 4])
def test_embedding_slices_add_up_to_the_whole_embedding(tiny, size):
    ids = torch.tensor([0, 1, 64, 65, 128, 129, 200, 257, 258, 258, 3])
    parts = [p.model.embed_tokens(ids) for p in split(tiny, size, split_vocab)]
    torch.testing.assert_close(sum(parts), tiny.model.embed_tokens(ids), rtol=0, atol=0)
    assert sum((p != 0).any(-1).long() for p in parts).tolist() == [1] * len(ids)  # each id on one rank


@pytest.mark.parametrize("size", [2, 3])
def test_tied_head_slices_side_by_side_are_the_whole_logits(tiny, size):
    hidden = torch.randn(5, 256, dtype=torch.float64)
    parts = split(tiny, size, split_vocab)
    slices = [p.compute_logits(hidden) for p in parts]
    assert [s.shape[1] for s in slices] == [cdiv(259, size)] * size  # padded to equal slices
    full = gather_logits(slices[0], Gathered(slices), 259)
    torch.testing.assert_close(full, tiny.compute_logits(hidden), rtol=1e-12, atol=1e-12)
    for p in parts:  # tied: the head is the embedding's own slice, held once
        assert p.lm_head_weight() is p.model.embed_tokens.weight


def test_each_rank_holds_half_the_vocabulary_rows(tiny):
    whole = tiny.weight_bytes()
    embedding = 259 * 256 * 8
    for part in split(tiny, 2):
        assert part.model.embed_tokens.weight.shape == (130, 256)
        assert part.weight_bytes() < whole / 2 + 256 * 8 * 16  # norms replicated; one padding row
    replicated = copy.deepcopy(tiny)
    shard_model(replicated, Rank(0, 2), vocab_parallel=False)
    assert replicated.weight_bytes() - split(tiny, 2)[0].weight_bytes() == embedding - 130 * 256 * 8


def test_untied_head_is_split_by_rows_and_gathered():
    config = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    for p in model.parameters():
        nn.init.normal_(p)
    model.finish_loading()
    hidden = torch.randn(4, 16, dtype=torch.float64)
    parts = split(model, 2)
    slices = [p.compute_logits(hidden) for p in parts]
    assert parts[1].lm_head.weight.shape == (19, 16) and not parts[1].lm_head.weight[18].any()  # 1 padding row
    torch.testing.assert_close(gather_logits(slices[0], Gathered(slices), 37), model.compute_logits(hidden),
                               rtol=1e-12, atol=1e-12)


def test_the_check_catches_an_embedding_that_does_not_mask_foreign_ids():
    """A plausible wrong embedding: ids outside the slice clamped into it, not zeroed."""
    torch.manual_seed(0)
    full = torch.randn(10, 4, dtype=torch.float64)
    ids = torch.tensor([0, 4, 5, 9])

    class Unmasked(VocabParallelEmbedding):
        def forward(self, input_ids):
            return nn.functional.embedding((input_ids - self.start).clamp(0, self.weight.shape[0] - 1), self.weight)

    for cls, right in ((VocabParallelEmbedding, True), (Unmasked, False)):
        parts = [cls(vocab_shard(full, r, 2), 5 * r, Rank(r, 2))(ids) for r in range(2)]
        assert torch.equal(sum(parts), full[ids]) is right


@pytest.mark.parametrize("tp, pp", [(2, 2), (4, 1), (1, 3), (2, 3)])
def test_ranks_are_laid_out_stage_by_stage_as_vllm_does(tp, pp):
    layouts = [RankLayout(tp, pp, rank, vocab_parallel=True) for rank in range(tp * pp)]
    assert [(l.stage, l.tp_rank) for l in layouts] == [(s, t) for s in range(pp) for t in range(tp)]
    assert all(l.rank_of(l.stage, l.tp_rank) == l.rank for l in layouts)
    assert [l.rank for l in layouts if l.computes_logits] == list(range(tp))  # stage 0 holds the head
    assert [l.rank for l in (RankLayout(tp, pp, r) for r in range(tp * pp)) if l.computes_logits] == [0]
