"""Conformance of every `attention_backend` on prefill batches (guarantee 3 of
`kvforge.core.AttentionBackend`): whole prompts, with lengths that are and are not
whole blocks."""

import pytest

from kvforge.core import ATTENTION_BACKEND
from kvforge.conformance.attention_cases import DTYPES, check_case, grid, report, skip_if_reduced, target
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)

KIND = ATTENTION_BACKEND
GROUP = "prefill"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["prefill", "aligned", "unaligned"])
def test_prefill_matches_float64_reference(registration, kind, dtype):
    tgt = target(registration)
    skip_if_reduced(tgt, kind)
    report([check_case(tgt, case) for case in grid(tgt, kind, dtype)])
