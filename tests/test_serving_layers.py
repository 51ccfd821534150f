"""The CLI loads `serving/` only when `serve` runs, so kvforge works without the
`serve` extra (what `serving/` may import is checked in test_layering.py)."""

from __future__ import annotations

import subprocess
import sys

def test_the_cli_does_not_import_the_server_until_serve_runs():
    code = "import sys, kvforge.cli; kvforge.cli.build_parser(); print('fastapi' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
