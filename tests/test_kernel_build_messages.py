"""A kernel build is never silent: it says what it builds, where and for how long,
shows that it is still running, and a failed one names the compiler, the command
that failed with the compiler's own error, and what runs without the kernels.

The builds here fail at once (a fake compiler) in a temporary cache
(KVFORGE_CACHE_DIR): nothing compiles and the real cache is never touched."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from kvforge.kernels.build_messages import ESTIMATE, BuildProgress, failure_summary, short_command

FAILING_COMPILER = """#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "-c" ]; then
    echo "$0: error: unrecognized command-line option '-fopenmp'" >&2
    exit 1
  fi
done
exec {real} "$@"
"""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def build_kernels(tmp_path, cxx: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CXX": cxx, "KVFORGE_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "kvforge", "build-kernels"], env=env, capture_output=True,
                          text=True, timeout=120)


def until(stream: io.StringIO, text: str, wait_s: float = 30.0) -> None:
    """Wait (at most `wait_s`) until `text` was written to `stream`."""
    deadline = time.monotonic() + wait_s
    while text not in stream.getvalue():
        assert time.monotonic() < deadline, f"{text!r} never appeared in:\n{stream.getvalue()}"
        time.sleep(0.02)


def test_a_build_off_a_terminal_logs_a_line_now_and_then_and_its_total():
    stream = io.StringIO()
    with BuildProgress("building the kernels (about a minute)", stream=stream, log_every_s=0.05):
        until(stream, "so far)")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kvforge: building the kernels (about a minute)"
    assert lines[1].startswith("kvforge: still building the C++ kernels (")
    assert lines[-1].startswith("kvforge: C++ kernel build done after ")


def test_a_build_on_a_terminal_shows_a_spinner_with_the_elapsed_seconds():
    stream = Terminal()
    with BuildProgress("building the kernels", stream=stream):
        until(stream, "building kvforge's C++ kernels (0 s)")
    assert "still building" not in stream.getvalue()  # the spinner replaces the periodic lines


def test_a_failed_build_says_so_with_its_duration():
    stream = io.StringIO()
    with pytest.raises(RuntimeError), BuildProgress("building", stream=stream):
        raise RuntimeError("compiler error")
    assert "kvforge: C++ kernel build failed after " in stream.getvalue()


NINJA_LOG = """Error building extension 'kvforge_cpp_attention': [1/7] c++ -MMD -MF a.o.d -DX=1 -I/k -isystem /t/include \
-fPIC -O3 -fopenmp -c /src/kernels/paged_attention.cpp -o paged_attention.o
FAILED: paged_attention.o
c++ -MMD -MF a.o.d -DX=1 -I/k -isystem /t/include -fPIC -O3 -fopenmp -c /src/kernels/paged_attention.cpp -o paged_attention.o
/src/kernels/paged_attention.cpp:12:5: error: 'foo' was not declared in this scope
   12 |     foo();
      |     ^~~
[2/7] c++ -c /src/kernels/linear.cpp -o linear.o
FAILED: linear.o
c++ -c /src/kernels/linear.cpp -o linear.o
/src/kernels/linear.cpp:1:1: error: bar
ninja: build stopped: subcommand failed.
"""


def test_the_failure_summary_keeps_the_failed_command_and_the_compiler_errors_only():
    summary = failure_summary(RuntimeError(NINJA_LOG))
    assert summary.splitlines() == [
        "`c++ -fPIC -O3 -fopenmp -c paged_attention.cpp` failed (1 other command(s) failed too):",
        "  /src/kernels/paged_attention.cpp:12:5: error: 'foo' was not declared in this scope",
    ]


def test_the_failure_summary_of_a_failed_compiler_check_names_the_command():
    error = subprocess.CalledProcessError(1, ["/bin/cc", "--version"], output=b"cc: broken\n")
    assert failure_summary(error) == "the compiler check `/bin/cc --version` exited with status 1: cc: broken"


def test_a_short_command_drops_include_paths_defines_and_outputs():
    assert short_command("g++ -MMD -MF x.d -DA=1 -I/a -isystem /b -O3 -c /s/k.cpp -o k.o") == "g++ -O3 -c k.cpp"


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="needs c++ and ninja")
def test_a_compiler_that_fails_is_named_with_its_flag_error_and_what_runs_without_the_kernels(tmp_path):
    compiler = tmp_path / "bin" / "c++"
    compiler.parent.mkdir()
    compiler.write_text(FAILING_COMPILER.format(real=shutil.which("c++")))
    compiler.chmod(0o755)
    result = build_kernels(tmp_path, str(compiler))
    assert result.returncode == 2, result.stderr
    announcement, *_ = result.stderr.splitlines()
    assert announcement.startswith("kvforge: building kvforge's C++ kernels (paged_attention.cpp")
    assert f"with {compiler} (from CXX) into {tmp_path / 'cache'}" in announcement and ESTIMATE in announcement
    assert "kvforge: C++ kernel build failed after" in result.stderr
    error = result.stderr[result.stderr.index("error: "):]
    assert f"`{compiler} -fPIC" in error
    # ninja compiles the sources in parallel: whichever fails first is named
    assert re.search(r"-fopenmp -std=c\+\+17( -\S+)* -c (\w+)\.cpp` failed", error), error
    assert "error: unrecognized command-line option '-fopenmp'" in error
    assert "--set attention.backend=sdpa" in error and "run as torch ops" in error
    assert "kvforge build-kernels" in error
    assert len(error.splitlines()) < 10  # the failure, not ninja's whole log
    assert (tmp_path / "cache" / "torch_extensions").is_dir()


def test_a_compiler_that_fails_its_check_is_named_with_that_check(tmp_path):
    false = shutil.which("false")
    result = build_kernels(tmp_path, false)
    assert result.returncode == 2
    assert f"the compiler check `{false} --version` exited with status 1" in result.stderr


def test_a_missing_compiler_is_refused_before_anything_runs(tmp_path):
    result = build_kernels(tmp_path, "no-such-compiler-here")
    assert result.returncode == 2
    assert "no C++ compiler ('no-such-compiler-here' not found on PATH; install g++ or set CXX)" in result.stderr
    assert "building kvforge's C++ kernels (" not in result.stderr  # nothing was announced: nothing ran


def test_a_cached_library_loads_without_a_word_on_stderr(tmp_path):
    from kvforge.kernels import build

    built = build.cached_library()
    if built is None:
        pytest.skip("the kernels are not built in this environment's cache")
    env = {**os.environ, "KVFORGE_CACHE_DIR": str(tmp_path / "cache")}
    target = subprocess.run([sys.executable, "-c", "from kvforge.kernels import build; print(build.build_dir())"],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(target)
    os.symlink(built, os.path.join(target, built.name))
    result = subprocess.run([sys.executable, "-m", "kvforge", "build-kernels"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"kvforge's C++ kernels are ready: {os.path.join(target, built.name)}\n"
