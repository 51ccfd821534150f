"""`auto` picks the best usable implementation and says why it skipped the others;
an explicit choice that cannot serve the configuration fails with its reasons."""

import pytest

from kvforge.core import (
    Availability,
    Registry,
    SchedulerPolicy,
    SelectionError,
    SelectionRequest,
    hookimpl,
)


class _Base(SchedulerPolicy):
    def waiting_key(self, request):
        return (request.arrival_index,)

    def choose_victim(self, running):
        return running[-1] if running else None


class Fast(_Base):
    name = "fast"
    priority = 50

    @classmethod
    def availability(cls):
        return Availability.no("needs CUDA (no GPU found)")


class Picky(_Base):
    name = "picky"
    priority = 40

    @classmethod
    def unsupported_reasons(cls, request):
        return [] if request.block_size == 16 else [f"block size {request.block_size} not in [16]"]


class Plain(_Base):
    name = "plain"
    priority = 1


class Exploding(_Base):
    name = "exploding"
    priority = 60

    @classmethod
    def availability(cls):
        raise RuntimeError("probe crashed")


class _Plugin:
    @hookimpl
    def kvforge_implementations(self):
        return [Fast, Picky, Plain, Exploding]


@pytest.fixture
def registry():
    registry = Registry()
    registry.register_plugin(_Plugin(), "local")
    return registry


def test_auto_picks_highest_priority_usable(registry):
    assert registry.select("scheduler_policy", "auto", SelectionRequest(block_size=16)).name == "picky"
    assert registry.select("scheduler_policy", "auto", SelectionRequest(block_size=32)).name == "plain"


def test_auto_explains_every_skipped_candidate(registry, caplog):
    with caplog.at_level("INFO", logger="kvforge.plugins"):
        registry.select("scheduler_policy", "auto", SelectionRequest(block_size=32))
    message = caplog.records[-1].message
    assert "auto chose scheduler_policy 'plain'" in message
    assert "needs CUDA" in message and "block size 32 not in [16]" in message and "probe crashed" in message


def test_explicit_choice_that_cannot_serve_fails_with_reasons(registry):
    with pytest.raises(SelectionError, match="'picky' cannot serve.*block size 32"):
        registry.select("scheduler_policy", "picky", SelectionRequest(block_size=32))
    with pytest.raises(SelectionError, match="unavailable: needs CUDA"):
        registry.select("scheduler_policy", "fast")


def test_availability_that_raises_counts_as_unavailable(registry):
    candidate = next(c for c in registry.candidates("scheduler_policy") if c.registration.name == "exploding")
    assert not candidate.usable
    assert "RuntimeError: probe crashed" in candidate.why_not()


def test_no_usable_implementation_lists_every_reason():
    registry = Registry()

    class OnlyFast:
        @hookimpl
        def kvforge_implementations(self):
            return [Fast]

    registry.register_plugin(OnlyFast(), "only-fast")
    with pytest.raises(SelectionError, match="fast: unavailable: needs CUDA"):
        registry.select("scheduler_policy", "auto")
