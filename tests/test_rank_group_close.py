"""`RankGroup.close` releases a gloo group before the process exits (left to the
exit, its threads were torn down mid-flight: an abort in about 1 of 8 torchrun
runs of `test_torchrun_executor`). Closing twice is fine; a collective after it
is refused with the reason, not a crash inside the backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvforge.core import DistributedError
from kvforge.distributed.group import RankGroup


def test_a_closed_group_refuses_collectives_and_closes_twice():
    group = RankGroup(dist.HashStore(), 0, 1, torch.device("cpu"), timeout_s=5.0)
    x = torch.ones(3)
    assert group.all_reduce(x).tolist() == [1.0, 1.0, 1.0]  # a group of one: the sum is itself
    group.close()
    group.close()
    with pytest.raises(DistributedError, match="closed group"):
        group.all_reduce(x)
