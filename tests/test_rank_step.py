"""A rank's step (distributed/rank_step.py) runs the model's last layer on the sampled
rows only where that is safe, and every rank agrees on when it did. The greedy-token
tests of tensor and pipeline parallelism check the results across processes; these
check the decision and one rank's logits in this process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvforge.distributed.layout import RankLayout
from kvforge.distributed.rank_step import RankStep
from kvforge.models import load_model
from kvforge.models.paged_driver import PagedDriver
from tests.model_driver import cpu_backends
from tests.test_output_rows import CONTEXT, NEW, ROWS, save_model


def rank_step(model, tp: int = 1, pp: int = 1, rank: int = 0) -> RankStep:
    return RankStep(model, SimpleNamespace(layout=RankLayout(tp, pp, rank)))


@pytest.mark.parametrize("pp, rows, tokens, opted_in, expected", [
    (1, 3, 10, True, True),    # some rows of the step: the last layer runs on them
    (2, 3, 10, True, True),    # the same with pipeline stages: the last stage sends those rows only
    (1, 0, 10, True, True),    # no row (a chunk ending mid-prompt): the last layer's attention and MLP skipped
    (2, 0, 10, True, False),   # ... but no stage sends an empty tensor
    (1, 10, 10, True, False),  # every token sampled: nothing to skip
    (1, 3, 10, False, False),  # a model that computes every row
])
def test_every_rank_decides_the_same_from_the_rows_alone(pp, rows, tokens, opted_in, expected):
    model = SimpleNamespace(computes_output_rows_only=opted_in)
    for rank in range(2 * pp):  # two tensor-parallel ranks per stage
        step = rank_step(model, tp=2, pp=pp, rank=rank)
        assert step.rows_only(torch.arange(tokens - rows, tokens), tokens) is expected


def test_one_rank_gives_the_logits_of_the_full_forward_and_plans_the_rows(tmp_path, monkeypatch):
    model = load_model(save_model(tmp_path, "llama"), dtype=torch.float32, attention_backend=cpu_backends()[0])
    drivers = [PagedDriver(model, 16, num_seqs=4, max_len=32, permute=True, seed=3) for _ in range(2)]
    generator = torch.Generator().manual_seed(1)
    first = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in CONTEXT]
    second = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in NEW]
    for driver in drivers:
        driver.step(first)
    rows = torch.tensor(ROWS)
    with torch.no_grad():
        input_ids, positions, batch = drivers[0].inputs(second)
        hidden = model.forward(input_ids, positions, drivers[0].kv_caches, model.plan(batch))
        expected = model.compute_logits(hidden[rows]).float()

        planned = []
        plan = model.plan
        monkeypatch.setattr(model, "plan", lambda b, *rest: planned.append(rest) or plan(b, *rest))
        input_ids, positions, batch = drivers[1].inputs(second)
        logits = rank_step(model).run(input_ids, positions, drivers[1].kv_caches, batch, rows)
    assert len(planned) == 1 and planned[0][0].tolist() == ROWS
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(drivers[1].kv_caches, drivers[0].kv_caches):
        assert torch.equal(ours, theirs)
