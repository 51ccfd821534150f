"""Running the code blocks of a documentation page as a reader would (for
tests/test_docs_examples.py).

A page runs once, in page order, in a fresh folder:
- a fenced block with `title="path"` is a file, written at that path first;
- ```python blocks run in one Python process, one after the other, sharing their
  names (a later block may use what an earlier one defined);
- ```sh, ```bash and ```console blocks run each in `bash -e -o pipefail`, with the
  environment's `bin/` first on PATH (`kvforge ...` as in an activated venv) and a
  `.venv` link to it (`.venv/bin/kvforge ...` as from the repository root). `pip
  install ./DIR` installs into the folder's `site/` (on PYTHONPATH), never into
  this environment, and refuses anything but a local directory. A leading
  `bash scripts/bootstrap.sh &&` is taken as done: the test environment is the
  bootstrapped one;
- a shell block of `kvforge serve` lines starts each server in the background and
  waits until it answers /health: the block's first server keeps running for the
  page's later blocks (the requests to it) until the page's next server block or
  its end; the others are stopped once they answered. The page's port 8000 is
  replaced by a free port of 127.0.0.1 throughout; every other server gets a free
  port of its own (`--port`, added where the line has none);
- placeholders the pages use for the reader's own files exist in the folder when a
  page names them: `./my-llama` (a small random Llama), `prompts.txt`,
  `engine.toml`, and `$KEY` in the environment;
- a block preceded, on the line just above its fence, by
  `<!-- docs-test: skip REASON -->` is not run (the test shows REASON).

Every block that runs has a time limit; a Python block that fails or times out
stops the page's later Python blocks, which report that.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s+(?P<reason>.+?)\s*-->\s*$")
SHELLS = ("sh", "bash", "console")
RUNS = ("python", *SHELLS)
BOOTSTRAP_PREFIX = re.compile(r"^bash scripts/bootstrap\.sh\s*&&\s*", re.MULTILINE)
SERVE_LINE = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/)?kvforge serve\b")
DOC_PORT = re.compile(r"\b8000\b")
PORT_OPTION = re.compile(r"--port[ =]\S+")
BLOCK_TIMEOUT_S = 300  # a bound for a hung block, not a measurement
SERVER_START_S = 180
KEY = "docs-example-key"

# The driver of a page's Python blocks: reads a block's file name per line on stdin,
# runs it with the block's output on fds 1 and 2, and answers one JSON line on the
# saved stdout: {"ok": true} or {"ok": false, "error": traceback}.
PYTHON_DRIVER = r"""
import json, os, sys, traceback
control = os.fdopen(os.dup(1), "w")
namespace = {"__name__": "__main__"}
for request in sys.stdin:
    path, log = request.rstrip("\n").split("\t")
    with open(log, "w") as out:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
        try:
            with open(path) as handle:
                exec(compile(handle.read(), path, "exec"), namespace)
            answer = {"ok": True}
        except BaseException:
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush(); sys.stderr.flush()
    control.write(json.dumps(answer) + "\n"); control.flush()
"""

# Sourced by every shell block (BASH_ENV): a failing command is named; `pip install` of a
# local directory goes to site/.
SHELL_SETUP = r"""
trap 'echo "docs-test: \`$BASH_COMMAND\` exited $?" >&2' ERR
pip() {
    if [ "$1" != install ]; then echo "the docs test runs only 'pip install ./DIR'" >&2; return 2; fi
    shift
    for arg in "$@"; do
        case "$arg" in ./*|/*) ;; *) echo "the docs test installs only local directories, not '$arg'; mark the" \
            "block <!-- docs-test: skip REASON --> if it must install from an index" >&2; return 2;; esac
    done
    "$KVFORGE_DOCS_PYTHON" -m pip install --quiet --no-deps --no-build-isolation --target "$KVFORGE_DOCS_SITE" "$@"
}
"""


@dataclass
class Block:
    page: str
    lang: str
    title: str | None
    body: str
    line: int  # the page line of the block's first code line
    skip: str | None = None

    @property
    def runs(self) -> bool:
        return self.title is None and self.lang in RUNS

    @property
    def starts_servers(self) -> bool:
        commands = command_lines(self.body)
        return self.lang in SHELLS and bool(commands) and all(SERVE_LINE.match(c) for c in commands)


@dataclass
class Result:
    ok: bool
    message: str = ""


def blocks(text: str, page: str = "page.md") -> list[Block]:
    found = []
    lines = text.splitlines()
    for match in FENCE.finditer(text):
        title = re.search(r'title="([^"]+)"', match["info"])
        fence_line = text.count("\n", 0, match.start())  # 0-based index of the fence line
        above = SKIP.match(lines[fence_line - 1].strip()) if fence_line > 0 else None
        found.append(Block(page, match["lang"], title[1] if title else None, match["body"], fence_line + 2,
                           above["reason"] if above else None))
    return found


def command_lines(body: str) -> list[str]:
    """The block's commands: lines without comments, continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", BOOTSTRAP_PREFIX.sub("", body))
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_fixtures(text: str, workdir: Path) -> None:
    """The reader's own files the page names, small."""
    if "./my-llama" in text:
        tiny_llama(workdir / "my-llama")
    if "prompts.txt" in text:
        (workdir / "prompts.txt").write_text("Once upon a time\nThe cat\n")
    if "engine.toml" in text:
        (workdir / "engine.toml").write_text("[scheduler]\nmax_num_seqs = 8\n\n[cache]\nnum_blocks = 64\n")


def tiny_llama(path: Path) -> None:
    """A random 2-layer Llama with the built-in tiny model's byte tokenizer (so text prompts work)."""
    import shutil

    import torch
    import transformers

    from kvforge.models.tokenizer import BYTE_TOKENIZER_FILE, resolve_model_dir

    config = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=256, eos_token_id=257, pad_token_id=258)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    shutil.copy(resolve_model_dir("kvforge-tiny") / BYTE_TOKENIZER_FILE, path / BYTE_TOKENIZER_FILE)


@dataclass
class PageRun:
    """One page's blocks, run in page order in `workdir`; `results` by block line."""

    text: str
    page: str
    workdir: Path
    results: dict[int, Result] = field(default_factory=dict)

    def __post_init__(self):
        self.port = free_port()
        self.site = self.workdir / "site"
        self.site.mkdir(parents=True, exist_ok=True)
        venv = Path(sys.prefix)
        (self.workdir / ".venv").symlink_to(venv, target_is_directory=True)
        setup = self.workdir / "docs_shell_setup.sh"
        setup.write_text(SHELL_SETUP)
        self.env = {**os.environ, "PYTHONPATH": str(self.site), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    "BASH_ENV": str(setup), "KVFORGE_DOCS_PYTHON": sys.executable,
                    "KVFORGE_DOCS_SITE": str(self.site), "KEY": KEY, "NO_PROXY": "127.0.0.1",
                    "no_proxy": "127.0.0.1"}
        self.env.pop("KVFORGE_PLUGINS", None)
        self._python: subprocess.Popen | None = None
        self._python_failed: str | None = None
        self._server: subprocess.Popen | None = None

    def run(self) -> dict[int, Result]:
        page_blocks = blocks(self.text, self.page)
        if any(b.starts_servers and not b.skip for b in page_blocks):
            for block in page_blocks:
                block.body = DOC_PORT.sub(str(self.port), block.body)
        for block in page_blocks:
            if block.title:
                path = self.workdir / block.title
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.body)
        make_fixtures(self.text, self.workdir)
        try:
            for block in page_blocks:
                if block.runs and not block.skip:
                    self.results[block.line] = self._run(block)
        finally:
            self._stop_python()
            self._stop_server()
        return self.results

    def _run(self, block: Block) -> Result:
        if block.lang == "python":
            return self._run_python(block)
        if block.starts_servers:
            return self._run_servers(block)
        return self._run_shell(block)

    # Python blocks: one process per page

    def _run_python(self, block: Block) -> Result:
        if self._python_failed:
            return Result(False, f"not run: an earlier python block of the page failed ({self._python_failed})")
        if self._python is None:
            self._python = subprocess.Popen([sys.executable, "-c", PYTHON_DRIVER], cwd=self.workdir, env=self.env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            start_new_session=True)
        stem = f"{Path(self.page).stem}_line_{block.line}"
        path, log = self.workdir / f"{stem}.py", self.workdir / f"{stem}.log"
        path.write_text("\n" * (block.line - 1) + block.body)  # tracebacks give the page's line numbers
        self._python.stdin.write(f"{path}\t{log}\n")
        self._python.stdin.flush()
        ready, _, _ = select.select([self._python.stdout], [], [], BLOCK_TIMEOUT_S)
        answer = json.loads(self._python.stdout.readline() or '{"ok": false, "error": "the process died"}') \
            if ready else {"ok": False, "error": f"timed out after {BLOCK_TIMEOUT_S} s"}
        if answer["ok"]:
            return Result(True)
        self._python_failed = f"{self.page}:{block.line}"
        self._stop_python()
        output = log.read_text()[-3000:] if log.exists() else ""
        return Result(False, f"{self.page}:{block.line}: the python block failed:\n{answer['error'][-3000:]}"
                             f"\nits output:\n{output}")

    def _stop_python(self) -> None:
        if self._python is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._python.pid, signal.SIGKILL)
            self._python.wait()
            self._python = None

    # Shell blocks

    def _run_shell(self, block: Block) -> Result:
        script = BOOTSTRAP_PREFIX.sub("", block.body)
        try:
            result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=self.workdir, env=self.env,
                                    capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return Result(False, f"{self.page}:{block.line}: the {block.lang} block timed out after {exc.timeout} s:\n"
                                 f"{(exc.stderr or b'')[-3000:]}")
        if result.returncode:
            return Result(False, f"{self.page}:{block.line}: the {block.lang} block exited {result.returncode}:\n"
                                 f"{(result.stdout + result.stderr)[-3000:]}")
        return Result(True)

    def _run_servers(self, block: Block) -> Result:
        self._stop_server()
        for index, command in enumerate(command_lines(block.body)):
            port = self.port if index == 0 else free_port()  # the first one serves the page's later blocks
            command = (PORT_OPTION.sub(f"--port {port}", command) if PORT_OPTION.search(command)
                       else f"{command} --port {port}")
            log = self.workdir / f"serve_line_{block.line}_{index}.log"
            with log.open("w") as out:
                server = subprocess.Popen(["bash", "-c", command], cwd=self.workdir, env=self.env,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            problem = self._wait_healthy(server, port)
            if problem is not None:
                _stop(server)
                return Result(False, f"{self.page}:{block.line}: `{command}` {problem}:\n{log.read_text()[-3000:]}")
            if index == 0:
                self._server = server  # the page's later blocks talk to it
            elif _stop(server) not in (0, -signal.SIGTERM):
                return Result(False, f"{self.page}:{block.line}: `{command}` did not stop cleanly on SIGTERM:\n"
                                     f"{log.read_text()[-3000:]}")
        return Result(True)

    def _wait_healthy(self, server: subprocess.Popen, port: int) -> str | None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if server.poll() is not None:
                return f"exited with {server.returncode} before it answered /health"
            with contextlib.suppress(OSError):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                try:
                    connection.request("GET", "/health")
                    if connection.getresponse().status == 200:
                        return None
                finally:
                    connection.close()
            time.sleep(0.2)
        return f"did not answer /health within {SERVER_START_S} s"

    def _stop_server(self) -> None:
        if self._server is not None:
            _stop(self._server)
            self._server = None


def _stop(process: subprocess.Popen) -> int:
    """SIGTERM (a server's graceful stop), then SIGKILL; its exit status."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait()
