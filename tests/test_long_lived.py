"""`long_lived_start_up`: the collector is paused while an engine is built, the
garbage start-up made is collected, and what lives on is frozen (later
collections skip it); a failed start freezes nothing."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvforge.cli import main
from kvforge.engine.long_lived import long_lived_start_up


class Node:
    def __init__(self):
        self.other = self  # a cycle: only the collector frees it


def test_start_up_runs_without_the_collector_then_collects_and_freezes_what_lives():
    gc.unfreeze()
    gc.enable()
    kept = Node()
    with long_lived_start_up():
        assert not gc.isenabled()
        dropped = weakref.ref(Node())  # cyclic garbage made during start-up
        made = Node()
        assert dropped() is not None  # not collected while paused
    assert gc.isenabled()
    assert dropped() is None  # collected once at the end, not frozen
    assert gc.get_freeze_count() > 0
    assert not any(o is made or o is kept for o in gc.get_objects())  # frozen: no collection walks them
    gc.unfreeze()
    assert any(o is made for o in gc.get_objects()) and kept.other is kept


def test_a_failed_start_freezes_nothing_and_restores_the_collector():
    gc.unfreeze()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError, match="no model"):
            with long_lived_start_up():
                raise RuntimeError("no model")
        assert gc.isenabled() is enabled and gc.get_freeze_count() == 0
    gc.enable()


def test_kvforge_generate_freezes_its_start_up():
    gc.unfreeze()
    assert main(["generate", "--model", "kvforge-tiny-draft", "--set", "cache.num_blocks=64", "--max-tokens", "2",
                 "--threads", "1", "--no-summary", "x"]) == 0
    assert gc.get_freeze_count() > 0 and gc.isenabled()
