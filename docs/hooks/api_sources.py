"""mkdocs hook: let mkdocstrings read `kvforge.core` from its source folder.

pyproject maps `kvforge.core` to the top-level folder `core/`, which a static
reader (griffe) cannot follow: it finds `kvforge/` and looks for `kvforge/core/`.
Importing instead would run code and lose attribute docstrings. So, before any
build starts (mkdocstrings drops search paths that do not exist yet when it reads
its configuration), this builds `build/api-src/kvforge/` (git-ignored): an empty
package whose `core` is a link to `core/`. mkdocs.yml points mkdocstrings there.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API_SOURCES = ROOT / "build" / "api-src"


def on_startup(command, dirty):
    package = API_SOURCES / "kvforge"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""kvforge (only its core is documented here)."""\n')
    link = package / "core"
    if link.is_symlink():
        link.unlink()  # it may point into another checkout
    link.symlink_to(ROOT / "core", target_is_directory=True)
