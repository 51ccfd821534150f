"""Every folder imports only the parts of kvforge that docs/architecture.md's
layout table allows, read from the source; and no folder but `kvforge/` imports
the command line (`kvforge.cli`, `kvforge.cli_*`), which sits on top of all of them.

Imports are read with their names (`from kvforge import cli_bench` is an import of
`kvforge.cli_bench`) and relative imports are resolved against the file's package.
A known exception is listed by file with its reason; an exception that is no
longer needed fails too, so the list cannot go stale."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> the kvforge packages its modules may import (besides their own folder); "kvforge": anything.
ALLOWED = {
    "core": (),
    "plugins": ("kvforge.core",),
    "backends": ("kvforge.core",),
    "backends/cpp": ("kvforge.core", "kvforge.kernels"),
    "kernels": ("kvforge.core",),
    "models": ("kvforge.core", "kvforge.kernels"),
    "engine": ("kvforge.core", "kvforge.models", "kvforge.kernels"),
    "conformance": ("kvforge.core",),
    "serving": ("kvforge.core", "kvforge.engine"),
    "vllm_plugin": ("kvforge.core",),
    "distributed": ("kvforge.core", "kvforge.models", "kvforge.engine"),
    "benchmarks": ("kvforge",),  # anything but the CLI (below)
    "kvforge": ("kvforge",),  # the public facade and the CLI
}
# file -> (import, why it is allowed for now)
EXCEPTIONS = {
    ("conformance/check_speculative_engine.py", "kvforge.engine"): "checks a proposer through the engine",
    ("conformance/check_structured_output_engine.py", "kvforge.engine"): "checks a grammar backend through the engine",
}


def own_package(folder: str) -> str:
    """The import path of a folder (pyproject.toml's package-dir): `kvforge/` is
    `kvforge`, every other folder `kvforge.<folder>`."""
    return "kvforge" if folder == "kvforge" else "kvforge." + folder.replace("/", ".")


def is_cli(name: str) -> bool:
    """Whether `name` is (something inside) a CLI module: `kvforge.cli` or `kvforge.cli_*`."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "kvforge" and (parts[1] == "cli" or parts[1].startswith("cli_"))


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def project_imports(source: str, package: str) -> list[str]:
    """The kvforge names a module of `package` imports: `import a.b` gives `a.b`,
    `from a import b` gives `a.b` (b may be a module or an attribute), relative
    imports resolved against `package`."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in names if within(name, "kvforge")]


def folder_files(folder: str, root: Path = ROOT) -> list[Path]:
    files = sorted((root / folder).glob("*.py"))
    if folder == "backends":  # its subpackage has its own row
        return files
    return files + sorted(p for p in (root / folder).glob("*/*.py") if f"{folder}/{p.parent.name}" not in ALLOWED)


def imports_of(folder: str, root: Path = ROOT) -> set[tuple[str, str]]:
    """(file relative to `root`, imported kvforge name) for every module of `folder`."""
    found = set()
    for path in folder_files(folder, root):
        package = own_package(str(path.parent.relative_to(root)))
        found |= {(str(path.relative_to(root)), name) for name in project_imports(path.read_text(), package)}
    return found


def violations(folder: str, root: Path = ROOT) -> set[tuple[str, str]]:
    """The imports of `folder` that its layout row does not allow, CLI imports outside `kvforge/` included."""
    allowed = ALLOWED[folder] + (own_package(folder),)
    return {(path, name) for path, name in imports_of(folder, root)
            if not any(within(name, a) for a in allowed) or (folder != "kvforge" and is_cli(name))}


def excused(violation: tuple[str, str]) -> tuple[str, str] | None:
    """The EXCEPTIONS key that allows this import (a package covers its modules), or None."""
    path, name = violation
    return next((key for key in EXCEPTIONS if key[0] == path and within(name, key[1])), None)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_the_layout_allows(folder):
    found = {v for v in violations(folder) if excused(v) is None}
    rule = "anything" if ALLOWED[folder] == ("kvforge",) else ALLOWED[folder]
    cli = "" if folder == "kvforge" else " and never the CLI (kvforge.cli, kvforge.cli_*)"
    assert not found, (f"{folder}/ may import only {rule}{cli} (docs/architecture.md, Layout):\n"
                       + "\n".join(f"{f}: {n}" for f, n in sorted(found)))


def test_every_listed_exception_is_still_needed():
    found = set().union(*(violations(folder) for folder in ALLOWED))
    stale = set(EXCEPTIONS) - {excused(v) for v in found}
    assert not stale, f"these exceptions no longer occur; remove them from EXCEPTIONS: {sorted(stale)}"


def test_a_benchmark_that_imports_the_cli_is_caught(tmp_path):
    # The edge this rule exists for: a benchmark taking constants from `kvforge bench`,
    # while the CLI imports the benchmarks; written three ways, inside a function too.
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "sweep.py").write_text(
        "from kvforge.benchmarks import harness\n"
        "def sweep():\n"
        "    from kvforge.cli_bench import FULL_MODEL\n"
        "    from kvforge import cli_bench\n"
        "    from .. import cli\n")
    assert violations("benchmarks", tmp_path) == {("benchmarks/sweep.py", "kvforge.cli_bench.FULL_MODEL"),
                                                  ("benchmarks/sweep.py", "kvforge.cli_bench"),
                                                  ("benchmarks/sweep.py", "kvforge.cli")}


def test_only_the_facade_may_import_the_cli(tmp_path):
    source = "from kvforge.cli_options import engine_config\nfrom kvforge import LLM\n"
    for folder in ("kvforge", "serving"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.py").write_text(source)
    assert violations("kvforge", tmp_path) == set()
    assert violations("serving", tmp_path) == {("serving/x.py", "kvforge.cli_options.engine_config"),
                                               ("serving/x.py", "kvforge.LLM")}
    assert not is_cli("kvforge.client") and not is_cli("kvforge.engine.cli") and is_cli("kvforge.cli")
