"""Conformance of every `attention_backend` on the optional features (guarantees 1
and 3 of `kvforge.core.AttentionBackend`): sliding window, logit soft-cap and ALiBi,
alone and together, exactly as `kvforge.core.attention` defines them. A backend
that does not declare a feature must refuse a layer that needs it."""

import random

import pytest
import torch

from kvforge.core import ALIBI, ATTENTION_BACKEND, LOGIT_SOFT_CAP, SLIDING_WINDOW
from kvforge.conformance.attention_cases import (
    DTYPES, QUERIES_PER_KV, check_case, fresh_seed, make_case, make_layer, report, target,
)
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)
from kvforge.conformance.attention_quick_grid import quick_window

KIND = ATTENTION_BACKEND
GROUP = "features"
pytestmark = pytest.mark.usefixtures("one_thread")
COMBINATIONS = {
    SLIDING_WINDOW: {SLIDING_WINDOW},
    LOGIT_SOFT_CAP: {LOGIT_SOFT_CAP},
    ALIBI: {ALIBI},
    "all": {SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI},
}


def feature_layer(features: set[str], head_size: int, ratio: int, window: int):
    # A cap of 1.5 bends scores of unit variance noticeably, so an ignored cap is caught.
    return make_layer(head_size, ratio, sliding_window=window if SLIDING_WINDOW in features else None,
                      soft_cap=1.5 if LOGIT_SOFT_CAP in features else None, alibi=ALIBI in features)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_feature_matches_float64_reference(registration, combination, dtype):
    tgt = target(registration)
    if tgt.reduced and dtype != torch.float32:
        pytest.skip(f"reduced grid for {tgt.name}: features in float32 only")
    features, seed = COMBINATIONS[combination], fresh_seed()
    rng = random.Random(seed)
    block_sizes = tgt.block_sizes()
    kinds = ["mixed"] if tgt.reduced else ["mixed", "long", "chunked"]
    cases = []
    for i, block_size in enumerate(sorted({block_sizes[0], block_sizes[-1]})):
        for j, kind in enumerate(kinds):
            head_size = tgt.head_sizes()[(i + j) % len(tgt.head_sizes())]
            ratio = 4 if tgt.reduced else QUERIES_PER_KV[(i + j) % len(QUERIES_PER_KV)]
            # windows shorter and longer than a block; the long sequence gets one that spans several;
            # the reduced grid, with no chance to draw again, one shorter than its batches' context
            if tgt.reduced:
                window = quick_window(block_size)
            elif kind == "long":
                window = rng.randint(60, 150)
            else:
                window = rng.randint(1, 2 * block_size + 3)
            layer = feature_layer(features, head_size, ratio, window)
            cases.append(make_case(kind, layer, block_size, dtype, seed + len(cases), tgt.reduced))
    report([check_case(tgt, case) for case in cases])
