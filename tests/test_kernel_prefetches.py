"""The kernels' prefetches are in the built library.

GCC counts a prefetch as no effect at all: a helper that only prefetches and is
not inlined early is found to do nothing, and its calls are deleted with every
prefetch in them (kernels/cpu_isa.h, KVFORGE_PREFETCH_HELPER). Nothing else
notices: the outputs stay the same and only the speed falls. So this reads the
library's machine code and asks, for each loop that fetches ahead, whether a
prefetch instruction is where the source puts one.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from kvforge.kernels import build

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
                                reason="reads x86-64 machine code with objdump")

# (function, the prefetch instruction it must hold, what asks for it in the source).
EXPECTED = [
    (r"run_tiles<float>\(.*\)::\{lambda\(long, long\)#2\}::operator\(\)", "prefetcht0",
     "linear.cpp prefetch_epilogue: a many-row linear's outputs and residual"),
    (r"run_tiles<unsigned short>\(.*\)::\{lambda\(long, long\)#2\}::operator\(\)", "prefetcht0",
     "linear.cpp prefetch_epilogue, bfloat16"),
]


@pytest.fixture(scope="module")
def instructions_by_function() -> dict[str, set[str]]:
    try:
        library = build.load()
    except Exception as error:  # noqa: BLE001 - the build's own message says why
        pytest.skip(f"the C++ kernels did not build here: {error}")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True,
                             text=True, check=True).stdout
    found: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = found.setdefault(header.group(1), set())
        elif current is not None and "prefetch" in line:
            current.update(re.findall(r"\bprefetch\w*", line))
    return found


@pytest.mark.parametrize("pattern, instruction, source", EXPECTED, ids=[e[2] for e in EXPECTED])
def test_a_loop_that_fetches_ahead_keeps_its_prefetch(instructions_by_function, pattern, instruction, source):
    functions = [name for name in instructions_by_function if re.search(pattern, name)]
    assert functions, f"no function matching {pattern!r} in the library: has the kernel been renamed?"
    holding = [name for name in functions if instruction in instructions_by_function[name]]
    assert holding, (f"{source}: none of {len(functions)} function(s) matching {pattern!r} holds a {instruction}; "
                     "the compiler deleted the prefetch (mark its helper KVFORGE_PREFETCH_HELPER)")
