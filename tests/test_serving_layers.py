"""`serving/` imports only `kvforge.core` and `kvforge.engine` from the project
(shared/DESIGN.md's layering), and the CLI loads it only when `serve` runs, so
kvforge works without the `serve` extra."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("kvforge.core", "kvforge.engine")


def project_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [name for name in names if name == "kvforge" or name.startswith("kvforge.")]


def test_serving_imports_only_core_and_engine():
    found = {f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "serving").glob("*.py")
             for name in project_imports(path) if not name.startswith(ALLOWED)}
    assert not found, "serving/ may import only kvforge.core and kvforge.engine:\n" + "\n".join(sorted(found))


def test_the_cli_does_not_import_the_server_until_serve_runs():
    code = "import sys, kvforge.cli; kvforge.cli.build_parser(); print('fastapi' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
