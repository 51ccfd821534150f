"""Conformance of every `attention_backend` that declares `batch_invariant` (guarantee
8 of `kvforge.core.AttentionBackend`): one sequence's output rows are bitwise the same
alone in one step, chunked into steps beside other sequences, as decodes, and at
another block size, over shapes drawn by hypothesis. Backends that do not declare it
have nothing to keep here."""

import pytest
import torch

from kvforge.core import ALIBI, ATTENTION_BACKEND, LOGIT_SOFT_CAP, SLIDING_WINDOW
from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)
from kvforge.conformance.attention_cases import SEED_ENV, make_layer, target

KIND = ATTENTION_BACKEND
GROUP = "batch_invariance"
pytestmark = pytest.mark.usefixtures("one_thread")
MAX_EXAMPLES = 12
THREADS = max(2, torch.get_num_threads())  # read before any check narrows it to one


def invariance_problems(tgt, draw) -> list[str]:
    """Draws one shape and four runs of a sequence through `tgt`'s backend (with
    hypothesis' `draw`, or any callable taking a strategy), and names each run whose
    rows differ from the first's."""
    from hypothesis import strategies as st

    from .attention_invariance import Run, Sequence, attend_run, chunking, differing_rows

    dtype = draw(st.sampled_from([d for d in tgt.dtypes() if d != torch.float64]))
    head_size = draw(st.sampled_from(tgt.head_sizes()))
    options = {}
    if SLIDING_WINDOW in tgt.cls.features and draw(st.booleans()):
        options["sliding_window"] = draw(st.integers(1, 40))
    if LOGIT_SOFT_CAP in tgt.cls.features and draw(st.booleans()):
        options["soft_cap"] = 30.0
    if ALIBI in tgt.cls.features and draw(st.booleans()):
        options["alibi"] = True
    layer = make_layer(head_size, draw(st.sampled_from([1, 4])), **options)
    sizes = [size for size in tgt.block_sizes() if not tgt.reasons(layer, size, dtype)]
    if not sizes:
        return []
    length = draw(st.integers(1, 60))
    seed = draw(st.integers(0, 2**16))
    sequence = Sequence.random(layer, length, dtype, torch.Generator().manual_seed(seed))

    def company(steps):
        others = [draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=3)) for _ in range(steps)]
        return others, [draw(st.integers(0, len(o))) for o in others]

    cuts = draw(st.lists(st.integers(1, max(1, length - 1)), max_size=4))
    chunks = chunking(length, cuts)
    decodes = chunking(length, [max(1, length - 3) + i for i in range(3)])
    runs = {"alone, one step": Run([(0, length)], sizes[0], seed=seed)}
    others, before = company(len(chunks))
    runs[f"chunked {chunks} among other sequences"] = Run(chunks, draw(st.sampled_from(sizes)), others, before,
                                                           seed + 1)
    others, before = company(len(decodes))
    runs[f"its last rows as decodes {decodes} among other sequences"] = Run(
        decodes, draw(st.sampled_from(sizes)), others, before, seed + 2)
    runs[f"alone, one step, block size {sizes[-1]}"] = Run([(0, length)], sizes[-1], seed=seed + 3)
    outputs = {what: attend_run(tgt.cls, layer, dtype, tgt.device, sequence, run) for what, run in runs.items()}
    first_label, first = next(iter(outputs.items()))
    label = f"{tgt.name} {layer} {dtype} over {length} tokens (block size {sizes[0]} first)"
    problems = []
    for what, rows in outputs.items():
        bad = differing_rows(first, rows)
        if not torch.isfinite(rows.float()).all():
            problems.append(f"{label}: {what}: non-finite output")
        elif bad:
            problems.append(f"{label}: rows {bad[:8]} {what} differ from {first_label}")
    return problems


def run_hypothesis(tgt, max_examples: int = MAX_EXAMPLES, shrink: bool = True) -> None:
    """`invariance_problems` over `max_examples` drawn shapes (derandomized, or from the
    run's pinned seed); fails with the first problems found (the smallest, unless
    `shrink` is False)."""
    import os

    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    def check(data):
        problems = invariance_problems(tgt, data.draw)
        assert not problems, "\n".join(problems)

    pinned = os.environ.get(SEED_ENV, "").strip()
    test = given(data=st.data())(check)
    test = seed(int(pinned))(test) if pinned else test
    phases = [phase for phase in Phase if shrink or phase not in (Phase.shrink, Phase.explain)]
    settings(max_examples=max_examples, deadline=None, database=None, derandomize=not pinned, phases=phases,
             suppress_health_check=list(HealthCheck))(test)()


def test_rows_are_bitwise_the_same_in_any_batch_chunking_and_block_size(registration):
    tgt = target(registration)
    if not tgt.cls.batch_invariant:
        not_applicable(f"{tgt.name} does not declare batch_invariant")
    run_hypothesis(tgt)


def test_rows_are_bitwise_the_same_on_many_threads(registration):
    """The drawn shapes run single-threaded for speed; this runs the parallel code paths too."""
    tgt = target(registration)
    if not tgt.cls.batch_invariant:
        not_applicable(f"{tgt.name} does not declare batch_invariant")
    torch.set_num_threads(THREADS)  # the one_thread fixture restores the setting
    run_hypothesis(tgt, max_examples=3)
