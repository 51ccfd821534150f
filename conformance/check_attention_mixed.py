"""Conformance of every `attention_backend` on mixed steps (guarantees 3 and 4 of
`kvforge.core.AttentionBackend`): prefills, prefill chunks over existing context and
decodes in one ragged batch; every head size against every query/KV head ratio;
one plan reused by several layers."""

import pytest
import torch

from kvforge.core import ATTENTION_BACKEND
from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import (
    DTYPES, QUERIES_PER_KV, another_layer, batch_to, check_case, fresh_seed, grid, make_case, make_layer, mismatch,
    oracle, relative_error, report, run_step, skip_if_reduced, target, TOLERANCES,
)
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)

KIND = ATTENTION_BACKEND
GROUP = "mixed"
pytestmark = pytest.mark.usefixtures("one_thread")
THREADS = max(2, torch.get_num_threads())  # read before any check narrows it to one


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mixed", "chunked"])
def test_mixed_step_matches_float64_reference(registration, kind, dtype):
    tgt = target(registration)
    skip_if_reduced(tgt, kind)
    report([check_case(tgt, case) for case in grid(tgt, kind, dtype)])


def test_every_head_size_with_every_head_ratio(registration):
    tgt = target(registration)
    if tgt.reduced:
        pytest.skip(f"reduced grid for {tgt.name}: head ratios are covered by the other mixed checks")
    dtype = torch.float32 if torch.float32 in tgt.cls.dtypes else tgt.dtypes()[0]
    block_size, seed = tgt.block_sizes()[-1], fresh_seed()
    report([check_case(tgt, make_case("mixed", make_layer(head_size, ratio), block_size, dtype, seed + i))
            for i, (head_size, ratio) in enumerate((h, r) for h in tgt.head_sizes() for r in QUERIES_PER_KV)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_plan_serves_every_layer_of_a_step(registration, dtype):
    tgt = target(registration)
    if dtype not in tgt.cls.dtypes:
        not_applicable(f"{tgt.name} does not declare {dtype}")
    seed = fresh_seed()
    case = make_case("mixed", make_layer(tgt.head_sizes()[0], 4), tgt.block_sizes()[0], dtype, seed, tgt.reduced)
    if tgt.reasons(case.layer, case.block_size, dtype):
        pytest.skip(f"{tgt.name} refuses {case.label}: {tgt.reasons(case.layer, case.block_size, dtype)}")
    second = another_layer(case, seed + 1)
    backend = tgt.cls(case.layer, case.cache_spec(), tgt.device)
    batch = batch_to(case.batch, tgt.device)
    before = {name: getattr(batch, name).clone() for name in ("query_start_loc", "seq_lens", "context_lens",
                                                              "block_table", "slot_mapping")}
    plan = backend.plan(batch)
    first_out = run_step(backend, case, tgt.device, plan)
    second_out = run_step(backend, second, tgt.device, plan)
    again = run_step(backend, case, tgt.device, plan)
    report([mismatch(first_out, oracle(case), case), mismatch(second_out, oracle(second), second)])
    changed = [name for name, t in before.items() if not torch.equal(t, getattr(batch, name))]
    assert not changed, f"{case.label}: plan/forward modified the batch's {changed}"
    error = relative_error(again, first_out)
    assert error <= TOLERANCES[dtype], f"{case.label}: the same layer run again with the same plan differs by {error:.3g}"


def test_many_threads_compute_the_same_step(registration):
    """The grid runs single-threaded for speed; this runs parallel code paths too."""
    tgt = target(registration)
    torch.set_num_threads(THREADS)  # the one_thread fixture restores the setting
    kinds = ["mixed"] if tgt.reduced else ["mixed", "decode", "long"]
    seed = fresh_seed()
    dtype = torch.float32 if torch.float32 in tgt.cls.dtypes else tgt.dtypes()[0]
    report([check_case(tgt, make_case(kind, make_layer(tgt.head_sizes()[-1], 4), tgt.block_sizes()[0], dtype,
                                      seed + i, tgt.reduced)) for i, kind in enumerate(kinds)])
