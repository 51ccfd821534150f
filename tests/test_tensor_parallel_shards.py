"""Tensor-parallel shards in one process, without workers: which heads each rank
holds, that the ranks' slices add up to the whole layer (float64), and that a
step's plan survives the trip to a worker."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from kvforge.core import AttentionBatch, ConfigError
from kvforge.distributed import head_shard, shard_model
from kvforge.distributed import step_message
from kvforge.distributed.layout import RankGroups, RankLayout
from kvforge.distributed.pipeline_parallel import split_stages
from kvforge.distributed.tensor_parallel import HeadShard, as_row_parallel
from kvforge.models import load_model
from kvforge.models.base import ModelConfig
from kvforge.models.gpt2 import GPT2LMHeadModel


class FakeGroup:
    """A rank of `size` whose all-reduce is a given function (each test supplies the sum)."""

    def __init__(self, rank: int, size: int, reduce=lambda x: x):
        self.rank, self.size, self.reduce = rank, size, reduce
        self.device = torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(x)


def shard_errors(shards: list[HeadShard], num_heads: int, num_kv_heads: int) -> list[str]:
    """What is wrong with these per-rank shards: query heads must be split evenly
    with nothing left out, and every query head must sit with the KV head it reads."""
    errors = []
    queries = sorted(h for s in shards for h in range(s.q_start, s.q_stop))
    if queries != list(range(num_heads)):
        errors.append(f"query heads covered: {queries}")
    group = num_heads // num_kv_heads
    for rank, s in enumerate(shards):
        needed = {h // group for h in range(s.q_start, s.q_stop)}
        if not needed <= set(range(s.kv_start, s.kv_stop)):
            errors.append(f"rank {rank} reads KV heads {sorted(needed)} but holds [{s.kv_start}, {s.kv_stop})")
    return errors


CASES = [(h, kv, size) for h, kv, size in itertools.product([4, 8, 12, 32], [1, 2, 4, 8], [1, 2, 4, 8])
         if kv <= h and h % kv == 0 and h % size == 0 and (kv % size == 0 if kv >= size else size % kv == 0)]


@pytest.mark.parametrize("num_heads, num_kv_heads, size", CASES)
def test_every_query_head_sits_with_its_kv_head(num_heads, num_kv_heads, size):
    shards = [head_shard(num_heads, num_kv_heads, rank, size) for rank in range(size)]
    assert shard_errors(shards, num_heads, num_kv_heads) == []
    held = [s.kv_stop - s.kv_start for s in shards]
    assert held == [max(1, num_kv_heads // size)] * size  # split when they can be, one replicated otherwise


def test_the_check_catches_kv_heads_replicated_round_robin():
    """A plausible wrong replication: 2 KV heads over 4 ranks dealt round-robin
    (rank % 2) puts rank 1's query heads (2, 3, which read KV head 0) with KV head 1."""
    broken = [HeadShard(r * 2, r * 2 + 2, r % 2, r % 2 + 1) for r in range(4)]
    assert shard_errors(broken, 8, 2) != []


@pytest.mark.parametrize("num_heads, num_kv_heads, size, hint", [
    (8, 4, 3, "choose one of: 1, 2, 4, 8"),
    (12, 6, 4, "does not divide the model's 6 KV heads"),
    (8, 2, 8, None),  # 8 ranks over 2 KV heads: fine (4 ranks share each)
    (12, 4, 6, "not a multiple of it"),
])
def test_sizes_that_do_not_divide_the_heads_are_refused_with_the_choices(num_heads, num_kv_heads, size, hint):
    if hint is None:
        head_shard(num_heads, num_kv_heads, 0, size)
        return
    with pytest.raises(ConfigError, match=hint):
        head_shard(num_heads, num_kv_heads, 0, size)


@pytest.fixture(scope="module")
def tiny():
    return load_model("kvforge-tiny", linear_kernel="torch").double()


def shards(model, size=2):
    out = []
    for rank in range(size):
        shard = copy.deepcopy(model)
        shard_model(shard, FakeGroup(rank, size))
        out.append(shard)
    return out


def test_the_ranks_mlp_slices_add_up_to_the_whole_mlp(tiny):
    x = torch.randn(5, 256, dtype=torch.float64)
    layer = tiny.model.layers[1]
    parts = [s.model.layers[1].mlp(x) for s in shards(tiny)]  # all-reduce left out: each rank's partial sum
    torch.testing.assert_close(parts[0] + parts[1], layer.mlp(x), rtol=1e-10, atol=1e-10)


def test_each_rank_keeps_the_qkv_rows_of_its_heads_and_reads_their_attention_outputs(tiny):
    full = tiny.model.layers[0].self_attn
    head = 32
    weight = full.qkv_proj.weight.view(8 + 4 + 4, head, 256)  # 8 query, 4 key, 4 value heads of kvforge-tiny
    out = torch.randn(3, 8 * head, dtype=torch.float64)
    partial = []
    for rank, shard in enumerate(shards(tiny)):
        attn = shard.model.layers[0].self_attn
        q, k, v = range(4 * rank, 4 * rank + 4), range(2 * rank, 2 * rank + 2), range(2 * rank, 2 * rank + 2)
        expected = torch.cat([weight[list(q)], weight[[8 + i for i in k]], weight[[12 + i for i in v]]])
        assert torch.equal(attn.qkv_proj.weight, expected.reshape(-1, 256))
        assert (attn.attn.spec.num_heads, attn.attn.spec.num_kv_heads) == (4, 2)
        partial.append(attn.o_proj.inner(out[:, rank * 4 * head:(rank + 1) * 4 * head]))
    torch.testing.assert_close(partial[0] + partial[1], full.o_proj(out), rtol=1e-10, atol=1e-10)
    assert shard.kv_cache_spec(16).num_kv_heads == 2


def test_a_row_parallel_bias_is_added_once_after_the_sum():
    torch.manual_seed(0)
    full = nn.Linear(6, 3, bias=True).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    layers = []
    partials = {}
    for rank in range(2):
        group = FakeGroup(rank, 2, reduce=lambda y: partials[0] + partials[1])
        part = nn.Linear(3, 3, bias=True).double()
        part.weight, part.bias = nn.Parameter(full.weight[:, 3 * rank:3 * rank + 3]), full.bias
        layers.append(as_row_parallel(part, group))
    for rank, layer in enumerate(layers):
        partials[rank] = layer.inner(x[:, 3 * rank:3 * rank + 3])
    for rank, layer in enumerate(layers):
        torch.testing.assert_close(layer(x[:, 3 * rank:3 * rank + 3]), full(x), rtol=1e-10, atol=1e-10)


def test_architectures_without_shards_are_refused_by_name():
    class OtherLM(nn.Module):
        pass

    with pytest.raises(ConfigError, match="Llama family.*GPT-2, not OtherLM.*tensor_parallel_size = 1"):
        shard_model(OtherLM(), FakeGroup(0, 2))
    config = ModelConfig(vocab_size=16, n_embd=8, n_head=2, n_layer=2, n_positions=8)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(config)
    with pytest.raises(ConfigError, match="Llama family.*not GPT2LMHeadModel.*pipeline_parallel_size = 1"):
        split_stages(gpt2, RankGroups(RankLayout(1, 2, 0), FakeGroup(0, 2), FakeGroup(0, 1)))  # its position
        # embedding is added to the token embedding's output, which a stage boundary replaces


class Wire:
    """Broadcasts recorded on the driver's side, replayed on the worker's."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.device = torch.device("cpu")

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        if root != 0:
            raise AssertionError("steps come from rank 0")
        if self.replaying:
            x.copy_(self.sent.pop(0))
        else:
            self.sent.append(x.clone())
        return x


def test_a_step_reaches_the_worker_as_sent():
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32), seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        context_lens=torch.tensor([0, 8], dtype=torch.int32), block_table=torch.tensor([[2, 0, 0], [5, 7, 1]],
                                                                                        dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 4], dtype=torch.int64), block_size=4, max_query_len=3, max_seq_len=9)
    sent = step_message.StepMessage(torch.tensor([11, 12, 13, 14]), torch.tensor([0, 1, 2, 8]), batch, [(3, 1), (6, 2)],
                                    logit_rows=torch.tensor([2, 3]))
    wire = Wire()
    wire.replaying = False
    step_message.send_step(wire, sent)
    step_message.send_command(wire, step_message.STOP)
    wire.replaying = True
    command, got = step_message.receive(wire, block_size=4)
    assert command == step_message.STEP
    assert torch.equal(got.input_ids, sent.input_ids) and torch.equal(got.positions, sent.positions)
    for name in ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping"):
        mine, theirs = getattr(got.batch, name), getattr(batch, name)
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype, name
    assert (got.batch.max_query_len, got.batch.max_seq_len, got.copies) == (3, 9, [(3, 1), (6, 2)])
    assert got.logit_rows.tolist() == [2, 3]  # the rows a vocabulary-parallel head computes on every rank
    assert step_message.receive(wire, block_size=4) == (step_message.STOP, None)
