"""`prepare()` runs on the implementation a host selected; under `auto` a failed
set-up (a kernel build that fails) moves on to the next usable one, and a named
one's failure is raised, never silently replaced."""

import logging

import pytest

from kvforge.core import ATTENTION_BACKEND, SCHEDULER_POLICY, KvforgeError, build_registry

PREPARE_SOURCE = '''
from kvforge.core import KvforgeError, SchedulerPolicy, hookimpl

PREPARED = []

class Broken(SchedulerPolicy):
    name = "broken-build"
    priority = 100

    @classmethod
    def prepare(cls):
        PREPARED.append(cls.name)
        raise KvforgeError("g++ -O3 failed: no such flag")

    def waiting_key(self, request):
        return (request.arrival_index,)

    def choose_victim(self, running):
        return running[-1] if running else None

class Fine(Broken):
    name = "fine-build"
    priority = 90

    @classmethod
    def prepare(cls):
        PREPARED.append(cls.name)

@hookimpl
def kvforge_implementations():
    return [Broken, Fine]
'''


@pytest.fixture
def registry(fake_site):
    fake_site.add("fakeplug-prepare", "1.0", {"fakeplug_prepare": PREPARE_SOURCE}, {"prepare": "fakeplug_prepare"})
    return build_registry(environ={})


def test_auto_takes_the_next_usable_implementation_when_prepare_fails(registry, caplog):
    import fakeplug_prepare

    with caplog.at_level(logging.WARNING, logger="kvforge.core.registry"):
        chosen = registry.select(SCHEDULER_POLICY, "auto", prepare=True)
    assert chosen.name == "fine-build"
    assert fakeplug_prepare.PREPARED == ["broken-build", "fine-build"]
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "broken-build" in warning and "g++ -O3 failed" in warning


def test_a_named_implementation_whose_prepare_fails_raises_its_error(registry):
    with pytest.raises(KvforgeError, match="g\\+\\+ -O3 failed"):
        registry.select(SCHEDULER_POLICY, "broken-build", prepare=True)


def test_without_prepare_nothing_is_set_up(registry):
    import fakeplug_prepare

    assert registry.select(SCHEDULER_POLICY, "auto").name == "broken-build"
    assert fakeplug_prepare.PREPARED == []


def test_a_failed_cpp_build_under_auto_falls_back_to_the_next_attention_backend(monkeypatch):
    from kvforge.core import SelectionRequest
    from kvforge.kernels import build

    def failing_load():
        monkeypatch.setattr(build, "_failure", "building failed: c++ -fopenmp: error")
        raise build.CppBuildError(build._failure)

    monkeypatch.setattr(build, "load", failing_load)
    monkeypatch.setattr(build, "is_loaded", lambda: False)
    monkeypatch.setattr(build, "cached_library", lambda: None)
    registry = build_registry(environ={})
    request = SelectionRequest(device="cpu", head_size=64, block_size=16, num_heads=4, num_kv_heads=4)
    chosen = registry.select(ATTENTION_BACKEND, "auto", request, prepare=True)
    assert chosen.name != "cpp"
    with pytest.raises(KvforgeError):  # cpp now reports itself unavailable, with the build's reason
        registry.select(ATTENTION_BACKEND, "cpp", request, prepare=True)
