"""Sharded loading in one process, without workers: each rank reads only its slices of
the checkpoint (safetensors `get_slice`), and what it builds from them is exactly the
split of the whole model in memory."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kvforge.distributed import shard_model
from kvforge.core import EngineConfig
from kvforge.distributed.layout import RankGroups
from kvforge.distributed.shard_loading import RankPart, dry_run_groups
from kvforge.models import load_model
from kvforge.models.loader import checkpoint_files, resolve_model_dir
from kvforge.models.weight_slices import WeightSlice


class Rank:
    """A rank whose collectives are never called while loading."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.device = rank, size, torch.device("cpu")


def groups(tp: int, pp: int, rank: int) -> RankGroups:
    config = EngineConfig(parallel={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
    return dry_run_groups(config, rank)


def load(part=None):
    return load_model("kvforge-tiny", dtype="float32", linear_kernel="torch", shard=part)


def stored_bytes(keep=lambda name: True) -> int:
    """Bytes of kvforge-tiny's checkpoint tensors (bfloat16 as stored) whose names pass `keep`."""
    total = 0
    for file in checkpoint_files(resolve_model_dir("kvforge-tiny")):
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():
                if keep(key):
                    tensor = reader.get_tensor(key)
                    total += tensor.numel() * tensor.element_size()
    return total


def test_the_whole_model_reads_the_whole_checkpoint():
    assert load().checkpoint_bytes_read == stored_bytes()


def test_a_rank_loaded_from_its_slices_equals_the_whole_model_split_in_memory():
    whole = load()
    for rank in range(2):
        expected = load()
        shard_model(expected, Rank(rank, 2))
        loaded = load(RankPart(groups(2, 1, rank)))
        want, got = expected.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert loaded.weight_bytes() < whole.weight_bytes() / 2 + 16 * 1024  # norms replicated, one padding row


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_reads_only_its_part_and_together_they_read_the_checkpoint_once(tp, pp):
    norms = stored_bytes(lambda key: "norm" in key)  # what every tensor-parallel rank reads whole
    read = [load(RankPart(groups(tp, pp, rank))).checkpoint_bytes_read for rank in range(tp * pp)]
    assert sum(read) == stored_bytes() + (tp - 1) * norms
    assert max(read) < stored_bytes() / (tp * pp) * 1.6  # stage 0 of 3 layers holds 2 and the embedding


def test_a_weight_slice_reads_the_spans_it_names_side_by_side():
    full = torch.arange(24).reshape(4, 6)
    assert torch.equal(WeightSlice(1, ((0, 2), (4, 6))).cut(full), full[:, [0, 1, 4, 5]])
    assert torch.equal(WeightSlice(0, ((1, 3),)).cut(full), full[1:3])
