"""Every folder imports only the parts of kvforge that docs/architecture.md's
layout table allows (shared/DESIGN.md's layering), read from the source.

A known exception is listed by file with its reason; an exception that is no
longer needed fails too, so the list cannot go stale."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> the kvforge packages its modules may import (besides their own folder).
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
    "distributed": ("kvforge.core", "kvforge.models", "kvforge.engine"),
}
OWN_PACKAGE = {"core": "kvforge.core", "plugins": "kvforge.plugins", "backends": "kvforge.backends",
               "backends/cpp": "kvforge.backends.cpp", "kernels": "kvforge.kernels", "models": "kvforge.models",
               "engine": "kvforge.engine", "conformance": "kvforge.conformance", "serving": "kvforge.serving",
               "distributed": "kvforge.distributed"}
# file -> (import, why it is allowed for now)
EXCEPTIONS = {
    ("conformance/check_speculative_engine.py", "kvforge.engine"): "checks a proposer through the engine",
}


def excused(violation: tuple[str, str]) -> tuple[str, str] | None:
    """The EXCEPTIONS key that allows this import (a package covers its modules), or None."""
    path, name = violation
    return next((key for key in EXCEPTIONS if key[0] == path and (name == key[1] or name.startswith(key[1] + "."))),
                None)


def project_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [name for name in names if name == "kvforge" or name.startswith("kvforge.")]


def folder_files(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).glob("*.py"))
    if folder == "backends":  # its subpackage has its own row
        return files
    return files + sorted(p for p in (ROOT / folder).glob("*/*.py") if f"{folder}/{p.parent.name}" not in ALLOWED)


def violations(folder: str) -> set[tuple[str, str]]:
    allowed = ALLOWED[folder] + (OWN_PACKAGE[folder],)
    return {(str(path.relative_to(ROOT)), name) for path in folder_files(folder)
            for name in project_imports(path)
            if not any(name == a or name.startswith(a + ".") for a in allowed)}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_the_layout_allows(folder):
    found = {v for v in violations(folder) if excused(v) is None}
    assert not found, f"{folder}/ may import only {ALLOWED[folder]}:\n" + "\n".join(f"{f}: {n}" for f, n in sorted(found))


def test_every_listed_exception_is_still_needed():
    found = set().union(*(violations(folder) for folder in ALLOWED))
    stale = set(EXCEPTIONS) - {excused(v) for v in found}
    assert not stale, f"these exceptions no longer occur; remove them from EXCEPTIONS: {sorted(stale)}"
