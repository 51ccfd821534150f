"""`pip install .` (a built wheel) carries every subpackage under the one name
`kvforge`, the built-in entry points, the console script and the pytest plugin."""

import subprocess
import sys
import zipfile

import pytest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    from pathlib import Path

    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(out), str(root)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("kvforge-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_maps_every_folder_under_kvforge(wheel):
    names = set(wheel.namelist())
    for module in ("kvforge/cli.py", "kvforge/core/api.py", "kvforge/core/registry.py", "kvforge/plugins/__init__.py",
                   "kvforge/backends/__init__.py", "kvforge/models/__init__.py", "kvforge/engine/__init__.py",
                   "kvforge/conformance/runner.py", "kvforge/conformance/conftest.py", "kvforge/benchmarks/__init__.py",
                   "kvforge/models/builtin/kvforge-tiny/model.safetensors",
                   "kvforge/models/builtin/kvforge-tiny-draft/config.json", "kvforge/benchmarks/peers/common.py"):
        assert module in names, module
    from kvforge.kernels import build

    for source in build.SOURCES + build.HEADERS:  # everything the just-in-time build compiles
        assert f"kvforge/kernels/{source.name}" in names, source.name
    assert not any(name.startswith(("core/", "tests/")) for name in names)


def test_wheel_declares_builtin_entry_points_and_console_script(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[kvforge.plugins]" in text and "scheduler-policies = kvforge.plugins.scheduler_policies" in text
    assert "kvforge = kvforge.cli:main" in text


def test_every_declared_builtin_plugin_imports_and_registers_cleanly():
    import tomllib
    from importlib import import_module
    from pathlib import Path

    from kvforge.core import Registry

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["kvforge.plugins"]
    registry = Registry(strict=True)
    for name, target in declared.items():
        registry.register_plugin(import_module(target), name, "kvforge", "test")
    assert not registry.errors
    assert len(registry.implementations()) >= len(declared)


def test_wheel_declares_the_pytest_plugin_and_it_certifies_from_an_installed_copy(wheel, tmp_path):
    import os

    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "[pytest11]\nkvforge = kvforge.conformance.pytest_plugin" in wheel.read(entry_points).decode()
    # installed, not editable: the suite is collected from site-packages, as in a plugin author's CI
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                              wheel.filename], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {name: value for name, value in os.environ.items() if not name.startswith(("KVFORGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--pyargs",
                          "kvforge.conformance", "--kvforge-plugin", "fcfs", "--kvforge-seed", "1"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "site/kvforge/conformance/check_scheduler_policy.py::" in run.stdout and " PASSED" in run.stdout
