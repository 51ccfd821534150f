"""The example third-party package under examples/ installs with pip and works
through entry points alone: discovered, selectable, conformant."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.core import SCHEDULER_POLICY, RequestView, build_registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kvforge-example-plugin"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    target = tmp_path_factory.mktemp("example-site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return target


def test_pip_installed_example_is_discovered_and_selectable(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    registry = build_registry(environ={})
    registration = registry.select(SCHEDULER_POLICY, "shortest-prompt")
    assert (registration.distribution, registration.version, registration.plugin) == ("kvforge-example-plugin", "0.1.0", "example")
    policy = registration.cls()
    long = RequestView("long", 0, 0.0, 0, num_prompt_tokens=500)
    short = RequestView("short", 0, 1.0, 1, num_prompt_tokens=5)
    assert sorted([long, short], key=policy.waiting_key) == [short, long]
    assert policy.choose_victim([short, long]) is long


def test_example_passes_the_shared_conformance_suite(installed_example, tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": str(installed_example)}
    result = subprocess.run([sys.executable, "-m", "kvforge", "conformance", "--plugin", "shortest-prompt"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "shortest-prompt" in result.stdout and "pass" in result.stdout
