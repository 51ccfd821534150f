"""Every ```python, ```sh, ```bash and ```console block of README.md and docs/ runs
as written, one test per block (its id is page:line).

How a page runs (in a fresh folder, once, in page order) is `docs_blocks`' docstring:
files from titled blocks, Python blocks in one process, shell blocks in bash with
the bootstrapped environment on PATH (`bash scripts/bootstrap.sh &&` is taken as
done: this environment is the bootstrapped one), `kvforge serve` blocks as
background servers for the page's later blocks, on a free port of 127.0.0.1.
A block that cannot run here says why on the line above its fence:
`<!-- docs-test: skip REASON -->`. Output samples, transcripts and pseudo-code are
```text (or bare ```) blocks, which never run; a bare block that holds commands a
reader would type fails `test_bare_blocks_hold_no_commands`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness sits beside this file
from docs_blocks import ROOT, Block, PageRun, Result, blocks  # noqa: E402

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
# The plugin tutorial and the guides it links: pages whose files, once installed, must pass conformance.
TUTORIALS = ["docs/writing_plugins.md", "docs/block_allocator.md", "docs/attention.md", "docs/quantization.md"]
# The start of a command a reader would type: a bare block holding one must be tagged and run.
COMMAND = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:kvforge|python3?|pip|pytest|bash|torchrun|ray|\.venv/bin/)"
                     r"(?:\s|$)")
_runs: dict[str, dict[int, Result]] = {}


def page_blocks(page: str) -> list[Block]:
    return blocks((ROOT / page).read_text(), page)


def page_results(page: str, tmp_path_factory) -> dict[int, Result]:
    """Every block result of `page`, from one run of the page (the first test of the page runs it)."""
    if page not in _runs:
        workdir = tmp_path_factory.mktemp(Path(page).stem)
        _runs[page] = PageRun((ROOT / page).read_text(), page, workdir).run()
    return _runs[page]


BLOCKS = [pytest.param(page, block.line, block.skip, id=f"{page}:{block.line}")
          for page in PAGES for block in page_blocks(page) if block.runs]


@pytest.mark.slow
@pytest.mark.parametrize("page, line, skip", BLOCKS)
def test_the_block_runs_as_written(page, line, skip, tmp_path_factory):
    if skip:
        pytest.skip(skip)
    result = page_results(page, tmp_path_factory).get(line)
    assert result is not None, f"{page} changed while the tests ran: no block starts at line {line} now; run again"
    assert result.ok, result.message


def test_bare_blocks_hold_no_commands():
    """A bare block never runs, so a command in one is never checked: tag it (```sh,
    ```python) so it runs, or ```text if it is output."""
    found = [f"{page}:{block.line}: {line.strip()}" for page in PAGES for block in page_blocks(page)
             if block.lang == "" for line in block.body.splitlines() if COMMAND.match(line)]
    assert not found, "bare blocks holding commands:\n" + "\n".join(found)


def test_a_skipped_block_says_what_it_needs():
    vague = [f"{page}:{block.line}: {block.skip!r}" for page in PAGES for block in page_blocks(page)
             if block.runs and block.skip and len(block.skip.split()) < 3]
    assert not vague, "a skip reason must say what the block needs or why it cannot run here:\n" + "\n".join(vague)


def test_the_tutorials_have_blocks_that_run():
    """A page whose blocks all became `text` would pass without checking anything."""
    langs = {page: [block.lang for block in page_blocks(page) if not block.skip] for page in TUTORIALS}
    assert all("python" in found for found in langs.values()), langs
    for page in ("docs/writing_plugins.md", "docs/block_allocator.md"):
        commands = [line for block in page_blocks(page) if block.lang == "console" for line in block.body.splitlines()]
        assert any(command.startswith("pip install ./") for command in commands), page
        assert any(command.startswith("kvforge conformance") for command in commands), page


# The harness itself, on pages with planted faults.

BROKEN_PAGE = """
```python
value = 1
```
Text between blocks.
```python
assert value == 2, "the second block sees the first one's names"
```
```python
print("never run")
```
<!-- docs-test: skip needs a machine this test does not have -->
```sh
exit 1
```
```sh
echo fine
false
```
"""


def test_a_failing_block_fails_naming_its_page_line_and_stops_the_later_python_blocks(tmp_path):
    results = PageRun(BROKEN_PAGE, "broken.md", tmp_path).run()
    assert results[3].ok and not results[7].ok and not results[10].ok
    assert "broken.md:7" in results[7].message and "the second block sees the first one's names" in results[7].message
    assert "an earlier python block of the page failed (broken.md:7)" in results[10].message
    assert 14 not in results  # skipped: never run
    assert not results[17].ok and "`false` exited 1" in results[17].message  # bash -e: a failed line fails it
    (block,) = [b for b in blocks(BROKEN_PAGE) if b.line == 14]
    assert block.skip == "needs a machine this test does not have"


def test_pip_installs_only_local_directories_and_never_into_this_environment(tmp_path):
    page = "```sh\npip install kvforge-something\n```\n```sh\npip uninstall -y kvforge\n```\n"
    results = PageRun(page, "unsafe.md", tmp_path).run()
    assert not results[2].ok and "installs only local directories" in results[2].message
    assert not results[5].ok and "runs only 'pip install ./DIR'" in results[5].message


@pytest.mark.slow
def test_a_server_block_serves_the_pages_later_requests_on_a_free_port(tmp_path):
    page = ("```sh\nkvforge serve kvforge-tiny --port 8000 --threads 1\n```\n"
            "```python\nimport urllib.request\n"
            "assert urllib.request.urlopen('http://127.0.0.1:8000/health').status == 200\n```\n")
    run = PageRun(page, "serve.md", tmp_path)
    results = run.run()
    assert results[2].ok, results[2].message
    assert results[5].ok, results[5].message
    assert run.port != 8000


@pytest.mark.slow
def test_a_tutorial_plugin_with_a_planted_bug_fails_its_documented_conformance_run(tmp_path):
    """The policy of writing_plugins.md without its arrival-order tie-break breaks
    guarantee 1; the page's own `kvforge conformance` line must then fail."""
    text = (ROOT / "docs/writing_plugins.md").read_text()
    planted = text.replace("return (request.num_prompt_tokens, request.arrival_index)",
                           "return (request.num_prompt_tokens,)")
    assert planted != text
    results = PageRun(planted, "docs/writing_plugins.md", tmp_path).run()
    failed = [r.message for r in results.values() if not r.ok]
    assert len(failed) == 1 and "`kvforge conformance --plugin shortest-prompt` exited 1" in failed[0], failed
