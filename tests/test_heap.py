"""The engine keeps freed heap memory (glibc) unless its config says not to."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch

from kvforge import LLMEngine
from kvforge.core import EngineConfig
from kvforge.models import heap

sys.path.insert(0, str(Path(__file__).parent))
from engine_fakes import FakeCausalLM  # noqa: E402

GLIBC = heap.glibc() is not None


def engine(keep: bool) -> LLMEngine:
    config = EngineConfig(device="cpu", dtype="float32", keep_freed_memory=keep, cache={"num_blocks": 8})
    return LLMEngine(config, model=FakeCausalLM())


@pytest.mark.parametrize("keep", [True, False])
def test_engine_applies_the_setting_only_when_configured(monkeypatch, keep):
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    engine(keep)
    assert calls == ([1] if keep else [])


def test_keep_freed_memory_does_nothing_outside_glibc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert heap.glibc() is None


@pytest.mark.skipif(not GLIBC, reason="not glibc")
def test_reallocating_a_large_tensor_then_costs_almost_no_page_faults():
    assert heap.keep_freed_memory() and heap.keep_freed_memory()  # idempotent
    pages = 16 * 2**20 // 4096
    for _ in range(6):  # the first ones may fault their pages in
        torch.empty(4 * 2**20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(4 * 2**20).fill_(1.0)  # 16 MiB, freed at once
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 2 * pages, f"{faults} page faults for 20 reuses of {pages} pages"


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not GLIBC or not Path("/proc/self/statm").is_file(), reason="not glibc on Linux")
def test_release_returns_the_memory_loading_freed():
    heap.keep_freed_memory()  # as the engine runs: freed blocks below 32 MiB stay in the heap
    tensors = [torch.ones(2**18) for _ in range(256)]  # 256 MiB in 1 MiB blocks, resident
    del tensors
    kept = resident_bytes()
    assert heap.release_free_memory()
    assert kept - resident_bytes() > 128 * 2**20


def test_the_engine_releases_what_loading_freed(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append(1) or True)
    engine(True)
    assert calls == [1]
