"""Every code block of the plugin tutorial and the guides it links runs as written.

For each page: fenced blocks with a `title="path"` are files, written at that path
in a fresh folder; every other ```python block runs, in page order, in one Python
process (a later block may use what an earlier one defined, as a reader would);
then every ```console block runs, one command a line. Console commands are limited
to what is safe here: `pip install ./DIR` (installed with --target into the
folder, never into this environment) and `kvforge ...` (run with that folder on
PYTHONPATH). Blocks in ```toml without a title and bare ``` blocks are not run;
use a bare or ```text block for a command this test must not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# writing_plugins.md and the authoring guides it links (speculative.md and
# conformance.md hold interface summaries and kvforge-internal code, not tutorials)
TUTORIALS = ["writing_plugins.md", "block_allocator.md", "attention.md", "quantization.md"]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SNIPPET_DRIVER = """
import sys
namespace = {"__name__": "__main__"}
for path in sys.argv[1:]:
    with open(path) as handle:
        exec(compile(handle.read(), path, "exec"), namespace)
"""


@dataclass
class Block:
    lang: str
    title: str | None
    body: str
    line: int  # where the block's first code line is in the page


def blocks(text: str) -> list[Block]:
    found = []
    for match in FENCE.finditer(text):
        title = re.search(r'title="([^"]+)"', match["info"])
        line = text.count("\n", 0, match.start("body")) + 1
        found.append(Block(match["lang"], title[1] if title else None, match["body"], line))
    return found


def console_commands(block: Block) -> list[tuple[int, list[str]]]:
    """(page line, argv) for each command of a console block, comments dropped."""
    commands = []
    for offset, line in enumerate(block.body.splitlines()):
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append((block.line + offset, argv))
    return commands


def safe_invocation(argv: list[str], site: Path) -> tuple[list[str], dict[str, str]]:
    """The command to run for a documented one, or ValueError if it is not one this
    test runs: it must never touch this environment or anything outside `site`."""
    env = {}
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if argv[:2] == ["pip", "install"] and len(argv) == 3 and argv[2].startswith("./"):
        return [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                "--target", str(site), argv[2]], env
    if argv[:1] == ["kvforge"]:
        return [sys.executable, "-m", "kvforge", *argv[1:]], env
    raise ValueError(f"{shlex.join(argv)!r} is not a command the docs test runs (pip install ./DIR or kvforge ...); "
                     f"put it in a bare ``` or ```text block if it must not run")


def run_page(text: str, page: str, workdir: Path) -> list[str]:
    """Run every block of one page in `workdir`; returns one message per failure."""
    site = workdir / "site"
    site.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("KVFORGE_PLUGINS", None)
    failures = []
    page_blocks = blocks(text)
    for block in page_blocks:
        if block.title:
            path = workdir / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
    snippets = []
    for block in page_blocks:
        if block.lang == "python" and not block.title:
            path = workdir / f"{Path(page).stem}_line_{block.line}.py"
            path.write_text("\n" * (block.line - 1) + block.body)  # tracebacks give the page's line numbers
            snippets.append(str(path))
    if snippets:
        result = subprocess.run([sys.executable, "-c", SNIPPET_DRIVER, *snippets], cwd=workdir, env=env,
                                capture_output=True, text=True, timeout=300)
        if result.returncode:
            failures.append(f"{page}: a python block failed (the file name gives the block's first line, the "
                            f"traceback the page's line):\n{result.stderr[-3000:]}")
    for block in page_blocks:
        if block.lang != "console":
            continue
        for line, argv in console_commands(block):
            try:
                command, extra_env = safe_invocation(list(argv), site)
            except ValueError as exc:
                failures.append(f"{page}:{line}: {exc}")
                continue
            result = subprocess.run(command, cwd=workdir, env={**env, **extra_env}, capture_output=True, text=True,
                                    timeout=600)
            if result.returncode:
                failures.append(f"{page}:{line}: `{shlex.join(argv)}` exited {result.returncode}:\n"
                                f"{(result.stdout + result.stderr)[-3000:]}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("page", TUTORIALS)
def test_every_block_of_the_tutorial_runs_as_written(page, tmp_path):
    failures = run_page((DOCS / page).read_text(), page, tmp_path)
    assert not failures, "\n\n".join(failures)


def test_the_tutorials_have_blocks_that_run():
    """A page whose blocks all became `text` would pass without checking anything."""
    langs = {page: [block.lang for block in blocks((DOCS / page).read_text())] for page in TUTORIALS}
    assert all("python" in found for found in langs.values()), langs
    for page in ("writing_plugins.md", "block_allocator.md"):
        commands = [" ".join(argv) for block in blocks((DOCS / page).read_text()) if block.lang == "console"
                    for _, argv in console_commands(block)]
        assert any(command.startswith("pip install ./") for command in commands), page
        assert any(command.startswith("kvforge conformance") for command in commands), page


# The harness itself, on pages with planted faults.

BROKEN_SNIPPET = """
```python
value = 1
```
Text between blocks.
```python
assert value == 2, "the second block sees the first one's names"
```
"""


def test_a_failing_python_block_fails_naming_its_page_line(tmp_path):
    (failure,) = run_page(BROKEN_SNIPPET, "broken.md", tmp_path)
    assert "broken_line_7.py" in failure and "the second block sees the first one's names" in failure


def test_a_command_that_could_touch_this_machine_is_refused_not_run(tmp_path):
    page = "```console\npip install kvforge-something\nrm -rf build\nkvforge --help\n```\n"
    failures = run_page(page, "unsafe.md", tmp_path)
    assert len(failures) == 2 and all("is not a command the docs test runs" in f for f in failures)
    assert "unsafe.md:2:" in failures[0] and "unsafe.md:3:" in failures[1]


@pytest.mark.slow
def test_a_tutorial_plugin_with_a_planted_bug_fails_its_documented_conformance_run(tmp_path):
    """The policy of writing_plugins.md without its arrival-order tie-break breaks
    guarantee 1; the page's own `kvforge conformance` line must then fail."""
    text = (DOCS / "writing_plugins.md").read_text()
    planted = text.replace("return (request.num_prompt_tokens, request.arrival_index)",
                           "return (request.num_prompt_tokens,)")
    assert planted != text
    failures = run_page(planted, "writing_plugins.md", tmp_path)
    assert len(failures) == 1 and "kvforge conformance --plugin shortest-prompt` exited 1" in failures[0], failures
