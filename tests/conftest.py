"""Shared fixtures: one torch thread, nothing left frozen, and throwaway plugin distributions on a temporary sys.path entry."""

from __future__ import annotations

import gc
import sys
import textwrap
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tests use tiny tensors, for which a thread pool only adds waiting (20-40x
    slower on a busy 2-core machine); tests that exercise parallel code set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def nothing_stays_frozen():
    """`kvforge generate` and `serve` freeze what start-up made (`engine.long_lived`):
    right for a process that runs one engine until it exits, not for the test process,
    which runs them in-process among thousands of others; unfreeze after each test."""
    yield
    gc.unfreeze()


class FakeSite:
    """A directory on sys.path where tests write real `*.dist-info` distributions,
    which importlib.metadata (and so the registry) discovers like installed ones."""

    def __init__(self, root: Path):
        self.root = root

    def add(self, dist: str, version: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[kvforge.plugins]\n{lines}\n")


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    yield FakeSite(root)
    for name in [m for m in sys.modules if m.startswith("fakeplug")]:
        del sys.modules[name]


POLICY_SOURCE = '''
from kvforge.core import SchedulerPolicy, hookimpl

class {cls}(SchedulerPolicy):
    name = "{name}"
    api_version = {api}

    def waiting_key(self, request):
        return (-request.arrival_index,)

    def choose_victim(self, running):
        return min(running, key=lambda r: r.arrival_index, default=None)

@hookimpl
def kvforge_implementations():
    return [{cls}]
'''


def policy_plugin(name: str, cls: str = "Policy", api: tuple[int, int] = (1, 0)) -> str:
    return POLICY_SOURCE.format(name=name, cls=cls, api=api)
