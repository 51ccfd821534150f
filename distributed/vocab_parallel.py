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
from kvforge.models.weight_slices import WeightSlice, rows, take_slices


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding (and head) each of `size` ranks holds, padding included."""
    return cdiv(vocab_size, size)


def vocab_span(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """The vocabulary rows `[start, stop)` of the checkpoint rank `rank` holds (the
    last rank's may be short: `pad_rows` fills it up to `vocab_rows`)."""
    each = vocab_rows(vocab_size, size)
    return min(rank * each, vocab_size), min((rank + 1) * each, vocab_size)


def pad_rows(weight: torch.Tensor, count: int) -> torch.Tensor:
    """`weight` with zero rows appended up to `count` rows."""
    if weight.shape[0] == count:
        return weight
    return torch.cat([weight, weight.new_zeros(count - weight.shape[0], *weight.shape[1:])])


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a whole `[vocab, hidden]` weight, zero-padded to `vocab_rows`; a copy."""
    start, stop = vocab_span(weight.shape[0], rank, size)
    return pad_rows(weight[start:stop].clone(), vocab_rows(weight.shape[0], size))


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


def _tables(model: nn.Module) -> dict[str, str]:
    """The model's vocabulary tables that are split, by parameter name: the embedding,
    and an untied head ("embedding" or "head")."""
    if isinstance(model, GPT2LMHeadModel):  # always tied
        return {"transformer.wte.weight": "embedding"}
    tables = {"model.embed_tokens.weight": "embedding"}
    if not model.tied:
        tables["lm_head.weight"] = "head"
    return tables


def vocab_slices(model: nn.Module, rank: int, size: int) -> dict[str, WeightSlice]:
    """Rank `rank`'s vocabulary rows of the embedding and an untied head."""
    return {name: rows(*vocab_span(model.vocab_size, rank, size)) for name in _tables(model)}


@torch.no_grad()
def apply_vocab(model: nn.Module, group) -> None:
    """Turn an embedding and head that hold this rank's vocabulary rows (`vocab_slices`)
    into a `VocabParallelEmbedding` and a smaller head, padded to `vocab_rows`, in place.
    A pipeline stage that has neither (its stand-ins are not `nn.Embedding`/`nn.Linear`)
    keeps its stand-ins."""
    each = vocab_rows(model.vocab_size, group.size)
    for name, kind in _tables(model).items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if not isinstance(owner, (nn.Embedding, nn.Linear)):
            continue
        weight = pad_rows(owner.weight.detach(), each)
        if kind == "embedding":
            replacement = VocabParallelEmbedding(weight, group.rank * each, group)
        else:
            replacement = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            replacement.weight = nn.Parameter(weight, requires_grad=False)
        parent_name, _, child = owner_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)


def split_vocab(model: nn.Module, group) -> None:
    """Keep this rank's vocabulary rows of a whole model in memory, in place (layers untouched)."""
    take_slices(model, vocab_slices(model, group.rank, group.size))
    apply_vocab(model, group)


def drop_head(model: nn.Module) -> None:
    """Free an untied LM head on a rank that computes no logits (a tied one is the embedding)."""
    if isinstance(model, LlamaForCausalLM) and not model.tied:
        model.lm_head = nn.Identity()


def gather_logits(local: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """The full `[rows, vocab_size]` logits from every rank's `[rows, vocab_rows]` slice."""
    return torch.cat(group.all_gather(local.contiguous()), dim=-1)[:, :vocab_size]
