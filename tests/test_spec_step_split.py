"""`benchmarks/spec_step_split.py` splits verification steps into phases: on
kvforge-tiny at batch 1, the steps it keeps for a proposer verified every
draft, no phase is negative, and together they stay within the step; every
configuration runs one decode pass per step (no multi-step burst hides the
forward from the phases)."""

import pytest

from kvforge.benchmarks import spec_step_split
from kvforge.benchmarks.model_dirs import model_dir


@pytest.fixture(scope="module")
def rows():
    return spec_step_split.measure("kvforge-tiny", str(model_dir("kvforge-tiny")), batch=1, num_tokens=4,
                                   tokens=24, repeats=1)


def test_kept_steps_verify_every_draft_and_phases_add_up(rows):
    by_name = {r["configuration"]: r for r in rows}
    assert by_name["none"]["drafts"] == 0 and by_name["none"]["x_plain"] == 1.0
    assert by_name["ngram"]["steps"] > 0 and by_name["ngram"]["drafts"] == 4
    for row in rows:
        if "error" in row:
            continue
        # the phases are timed inside the step: together they never exceed it (the rest is what is left)
        assert all(row[c] >= 0 for c in ("propose", "build inputs", "forward + logits", "sample"))
        assert row["rest"] >= -1.0 and row["forward + logits"] < row["step"]
    assert by_name["none"]["propose"] == 0 and by_name["ngram"]["propose"] > 0
    # a plain step is mostly its forward; a burst's passes would land in "rest"
    assert by_name["none"]["forward + logits"] > by_name["none"]["rest"]
    # a step per output token (24 tokens: 23 decode steps, the last, which ends the
    # request, not kept); bursts of up to 16 passes would make two or three
    assert by_name["none"]["steps"] >= 20


def test_the_table_has_a_row_per_configuration(rows):
    table = spec_step_split.markdown(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| kvforge-tiny | 1 | ngram |" in table
