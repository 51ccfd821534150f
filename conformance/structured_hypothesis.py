"""Hypothesis-driven walks for `check_structured_output` (kept apart so that listing
the check modules does not import hypothesis before pytest starts): the derandomized
walks first, the same in every run, then as many drawn from the run's pinned seed."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvforge.core import StructuredOutputBackend, Vocabulary

from .attention_cases import SEED_ENV
from .structured_corpus import Case
from .structured_walks import Walker


def run_hypothesis_walks(backend: StructuredOutputBackend, vocabulary: Vocabulary, cases: list[Case],
                         max_examples: int) -> None:
    def walk(data):
        case = data.draw(st.sampled_from(cases), label="case")
        stretch = data.draw(st.integers(0, 60), label="random tokens before the finisher")
        Walker(backend, vocabulary, case).run(
            lambda allowed, step: data.draw(st.integers(0, len(allowed) - 1)) if step < stretch else None)

    pinned = os.environ.get(SEED_ENV, "").strip()
    for derandomize in (True, False) if pinned else (True,):
        test = given(data=st.data())(walk)
        test = test if derandomize else seed(int(pinned))(test)
        settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
                 suppress_health_check=list(HealthCheck))(test)()
