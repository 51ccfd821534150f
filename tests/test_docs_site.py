"""The documentation site builds with `mkdocs build --strict`, and its API reference
covers every module of `kvforge.core` from the docstrings themselves (so a docstring
that breaks the build, a page missing from the nav or a broken anchor fails here).

The build needs the `docs` extra (`pip install -e '.[docs]'`, installed by
scripts/bootstrap.sh); without mkdocs only the checks that need no build run."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvforge.core

ROOT = Path(__file__).resolve().parents[1]
needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason="mkdocs is not installed: pip install -e '.[docs]'")


def core_modules() -> list[str]:
    return sorted(module.name for module in pkgutil.iter_modules(kvforge.core.__path__))


def nav_pages() -> list[str]:
    return re.findall(r"^\s+- [^:\n]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)


def test_every_core_module_has_an_api_page_in_the_nav():
    missing = [name for name in core_modules() if f"api/{name}.md" not in nav_pages()]
    assert not missing, f"add docs/api/NAME.md (`::: kvforge.core.NAME`) and a nav entry in mkdocs.yml for: {missing}"
    for name in core_modules():
        assert (ROOT / "docs" / "api" / f"{name}.md").read_text().strip() == f"::: kvforge.core.{name}"


def test_every_doc_page_is_in_the_nav():
    pages = sorted(str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs").rglob("*.md"))
    missing = sorted(set(pages) - set(nav_pages()))
    assert not missing, f"add these pages to the nav in mkdocs.yml: {missing}"
    assert not sorted(set(nav_pages()) - set(pages)), "mkdocs.yml names pages that do not exist"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + result.stdout + result.stderr
    return out


@needs_mkdocs
def test_api_reference_renders_each_interface_with_its_numbered_guarantees(site):
    for module, cls in (("attention", "AttentionBackend"), ("block_allocator", "BlockAllocator"),
                        ("scheduler_policy", "SchedulerPolicy"), ("quantizer", "Quantizer"),
                        ("speculative", "SpeculativeProposer"), ("structured_output", "StructuredOutputBackend"),
                        ("structured_output", "Grammar")):
        page = (site / "api" / module / "index.html").read_text()
        assert f'id="kvforge.core.{module}.{cls}"' in page, f"{cls} is missing from its API page"
        assert "Guarantees every implementation keeps" in page
        assert re.search(r"<ol>\s*<li>", page), f"{cls}'s guarantees are not rendered as a numbered list"
    allocator = (site / "api" / "block_allocator" / "index.html").read_text()
    assert '<ol start="7">' in allocator, "the prefix-caching guarantees must keep their numbers 7-12"
    assert 'id="kvforge.core.block_allocator.BlockAllocator.reset_prefix_cache"' in allocator


@needs_mkdocs
def test_attribute_docstrings_are_read_statically(site):
    """A static read keeps the docstrings written under constants (an import would lose them)."""
    kv_cache = (site / "api" / "kv_cache" / "index.html").read_text()
    assert "The default KV layout" in kv_cache  # the docstring under NHD


@needs_mkdocs
def test_generated_config_reference_is_a_page_of_the_site(site):
    page = (site / "config_reference" / "index.html").read_text()
    assert "KVFORGE_CACHE__BLOCK_SIZE" in page
