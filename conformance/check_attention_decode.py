"""Conformance of every `attention_backend` on decode batches (guarantee 3 of
`kvforge.core.AttentionBackend`): one new token per sequence, and one long sequence."""

import pytest

from kvforge.core import ATTENTION_BACKEND
from kvforge.conformance.attention_cases import DTYPES, check_case, grid, report, skip_if_reduced, target
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)

KIND = ATTENTION_BACKEND
GROUP = "decode"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["decode", "long"])
def test_decode_matches_float64_reference(registration, kind, dtype):
    tgt = target(registration)
    skip_if_reduced(tgt, kind)
    report([check_case(tgt, case) for case in grid(tgt, kind, dtype)])
