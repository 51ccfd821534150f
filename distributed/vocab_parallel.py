"""Vocabulary-parallel token embedding and LM head (Megatron style).

Under tensor parallelism over N ranks each rank keeps `cdiv(vocab, N)` rows of
the embedding (and of an untied head): rank r rows `[r * rows, (r + 1) * rows)`,
the last rank's slice padded with zero rows when N does not divide the vocabulary.
* The embedding looks up the ids inside its rows, writes zeros for the others,
  and all-reduces: each token's vector comes from exactly one rank.
* The head computes its slice of the logits, `[tokens, rows]`, with whatever
  kernel the model packs or quantizes it into (it is an ordinary, smaller head);
  `gather_logits` puts the slices side by side and cuts the padding off. Only the
  rows the driver samples are computed, so the gather moves `[sampled, vocab]`.
A tied head is the embedding's own slice, so tying survives the split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core import cdiv
from kvforge.models.gpt2 import GPT2LMHeadModel
from kvforge.models.llama import LlamaForCausalLM


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding (and head) each of `size` ranks holds, padding included."""
    return cdiv(vocab_size, size)


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a `[vocab, hidden]` weight, zero-padded to `vocab_rows`; a copy."""
    rows = vocab_rows(weight.shape[0], size)
    part = weight[rank * rows:(rank + 1) * rows]
    if part.shape[0] == rows:
        return part.clone()
    pad = weight.new_zeros(rows - part.shape[0], weight.shape[1])
    return torch.cat([part, pad])


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a token embedding; the full lookup is the sum over the ranks."""

    def __init__(self, weight: torch.Tensor, start: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


def _embedding(embedding: nn.Embedding, group) -> VocabParallelEmbedding:
    rows = vocab_rows(embedding.weight.shape[0], group.size)
    return VocabParallelEmbedding(vocab_shard(embedding.weight.detach(), group.rank, group.size),
                                  group.rank * rows, group)


@torch.no_grad()
def split_vocab(model: nn.Module, group) -> None:
    """Keep this rank's vocabulary rows of the embedding and the LM head of a loaded
    Llama-family model or GPT-2, in place (tied heads read the embedding's rows)."""
    if isinstance(model, GPT2LMHeadModel):  # always tied
        model.transformer.wte = _embedding(model.transformer.wte, group)
        return
    model.model.embed_tokens = _embedding(model.model.embed_tokens, group)
    if not model.tied:
        head = nn.Linear(1, 1, bias=False, device="meta")
        head.weight = nn.Parameter(vocab_shard(model.lm_head.weight.detach(), group.rank, group.size),
                                   requires_grad=False)
        head.in_features, head.out_features = head.weight.shape[1], head.weight.shape[0]
        model.lm_head = head


def drop_head(model: nn.Module) -> None:
    """Free an untied LM head on a rank that computes no logits (a tied one is the embedding)."""
    if isinstance(model, LlamaForCausalLM) and not model.tied:
        model.lm_head = nn.Identity()


def gather_logits(local: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """The full `[rows, vocab_size]` logits from every rank's `[rows, vocab_rows]` slice."""
    return torch.cat(group.all_gather(local.contiguous()), dim=-1)[:, :vocab_size]
