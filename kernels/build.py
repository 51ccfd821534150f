"""Just-in-time build of the C++ kernels, cached on disk across processes.

`scripts/bootstrap.sh` (or `kvforge build-kernels`) compiles `paged_attention.cpp`,
`int8_linear.cpp`, `int8_dynamic_linear.cpp`, `linear.cpp`, `rms_norm_rotary.cpp`,
`inverse_cdf.cpp`, `greedy_rows.cpp`, `sample_rows.cpp`, `lora.cpp`,
`int8_packed_linear.cpp` and `decoder_stack.cpp` into one library with `torch.utils.cpp_extension.load`, into
a build directory keyed by the torch and Python versions and the sources'
digest; every later process finds the library there and only loads it. A
process that must build it (no set-up build, or changed sources) says on
stderr what it builds, where, how long it takes, and shows that it is still
running (`build_messages`). Torch's own lock file in that directory keeps
concurrent first uses from building twice.

`KVFORGE_CACHE_DIR` moves the cache (default `~/.cache/kvforge`); the build
lives in its `torch_extensions/` subfolder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from kvforge.core.errors import KvforgeError

from .build_messages import ESTIMATE, BuildProgress, failure_summary

NAME = "kvforge_cpp_attention"
HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "paged_attention.cpp", HERE / "int8_linear.cpp", HERE / "int8_dynamic_linear.cpp",
           HERE / "linear.cpp", HERE / "rms_norm_rotary.cpp", HERE / "inverse_cdf.cpp", HERE / "lora.cpp",
           HERE / "decoder_stack.cpp", HERE / "int8_packed_linear.cpp", HERE / "greedy_rows.cpp",
           HERE / "sample_rows.cpp"]
HEADERS = [HERE / "cpu_isa.h", HERE / "vector_kernels.h", HERE / "vector_exp.h", HERE / "attention_tile.h",
           HERE / "decode_tile.h", HERE / "prefill_tile.h", HERE / "prefill_tile_avx2.h", HERE / "prefill_bf16.h",
           HERE / "quantized_write.h",
           HERE / "int8_linear_tile.h", HERE / "int8_linear_bf16.h", HERE / "bf16_vectors.h",
           HERE / "decoder_stack_ops.h",
           HERE / "linear_tile.h", HERE / "bf16_linear_dpbf16.h", HERE / "rms_norm_rotary_rows.h",
           HERE / "f32_packed_rows.h", HERE / "int8_rows.h", HERE / "int8_linear_common.h", HERE / "lora_tile.h",
           HERE / "int8_packed_tile.h", HERE / "native_vectors.h",
           HERE / "invariant_tile.h", HERE / "transpose16.h", HERE / "narrow_rows.h", HERE / "narrow_bf16.h",
           HERE / "row_penalties.h"]
CACHE_ENV = "KVFORGE_CACHE_DIR"
# -O3 vectorises the inner loops; the AVX2+FMA variant is chosen at run time
# inside the library, so no -march=native (the build must run on any x86-64).
# Every function and loop starts a 64-byte line, so a kernel whose code did not
# change keeps its loops' alignment when other code grows or shrinks
# (docs/cpp_backend.md, "Building").
CFLAGS = ["-O3", "-fopenmp", "-std=c++17", "-falign-functions=64", "-falign-loops=64"]

# A build takes a minute or two; torch's lock file older than this belongs to a
# build that was killed (its process gone), and would make every later load wait forever.
STALE_LOCK_S = 900.0

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: str | None = None  # path of the loaded library
_failure: str | None = None  # why the build failed in this process


# What runs without the library: said once in every build failure, where the reader needs it.
WITHOUT_LIBRARY = ("Without these kernels the 'cpp' attention backend cannot run (attention.backend = auto moves "
                   "on to the next backend, e.g. sdpa; a config naming cpp must choose another, e.g. --set "
                   "attention.backend=sdpa), and linear layers, RMSNorm, rotary and W8A8 run as torch ops")


class CppBuildError(KvforgeError, RuntimeError):
    """kvforge's C++ kernel library could not be compiled or loaded."""


def source_digest() -> str:
    """Hash of the sources, headers and flags: torch's own check ignores headers."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """kvforge's on-disk cache: `KVFORGE_CACHE_DIR`, default `~/.cache/kvforge` (the
    kernel build, and the tokenizer classes `models.tokenizer_choice` remembers)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvforge")


def build_dir() -> Path:
    """Where the compiled library lives for this torch, Python and source version."""
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / "torch_extensions" / tag / f"{NAME}-{source_digest()}"


def find_compiler() -> str | None:
    """The C++ compiler torch would use ($CXX, else c++), or None if it is not on PATH."""
    wanted = os.environ.get("CXX", "c++")
    return shutil.which(wanted.split()[0]) if wanted else None


def missing_tools() -> str | None:
    """Why a build cannot start here, or None. Checks files only; compiles nothing."""
    compiler = find_compiler()
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found on PATH; install g++ or set CXX)"
    if shutil.which("ninja") is None:
        return "no ninja build tool (torch's JIT build needs it; `pip install ninja`)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h; install the python3-dev package)"
    return None


def cached_library() -> Path | None:
    """The library already built from these very sources, else None."""
    built = sorted(build_dir().glob(f"{NAME}*.so"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def clear_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove torch's build lock in `directory` when it is older than `STALE_LOCK_S`
    (left by a build that was killed); True if one was removed."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    log.warning("removing %s, a build lock %.0f s old: the build that held it was killed", lock, age)
    lock.unlink(missing_ok=True)
    return True


def failure() -> str | None:
    """Why an earlier build in this process failed, or None."""
    return _failure


def is_loaded() -> bool:
    return _loaded is not None


def load() -> str:
    """Build (if needed) and load the kernel library; registers `torch.ops.kvforge_cpp`.

    Returns the library path. A build says on stderr what it compiles and shows
    its progress. Raises `CppBuildError` naming the compiler, the failed command
    and its first error lines, and what runs without the library; later calls in
    the same process fail fast with it.
    """
    global _loaded, _failure
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise CppBuildError(_failure)
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory)
        built = cached_library()
        if built is not None and not (directory / "lock").exists():
            # Built earlier from these very sources and no build is running: load it
            # directly, which needs neither ninja nor a compiler.
            torch.ops.load_library(str(built))
            _loaded = str(built)
        else:
            _loaded = _build(directory)
        from . import fake  # noqa: F401  (registers the fake implementations)

        return _loaded


def _build(directory: Path) -> str:
    """Compile (or wait for another process compiling) the library into `directory`, with
    progress on stderr; sets `_failure` and raises `CppBuildError` when it fails."""
    global _failure
    compiler = find_compiler() or os.environ.get("CXX", "c++")
    if os.environ.get("CXX"):
        compiler += " (from CXX)"
    if (directory / "lock").exists():  # waiting needs no toolchain: the other process compiles
        announcement = (f"waiting for another process that is building kvforge's C++ kernels in {directory} "
                        f"({ESTIMATE} in all)")
    else:
        missing = missing_tools()
        if missing is not None:
            _failure = f"kvforge's C++ kernels cannot be built here: {missing}. {WITHOUT_LIBRARY}"
            raise CppBuildError(_failure)
        announcement = (f"building kvforge's C++ kernels ({', '.join(s.name for s in SOURCES)}) with {compiler} "
                        f"into {directory}; this happens once per kvforge, torch and Python version and takes "
                        f"{ESTIMATE} (`kvforge build-kernels` does it ahead of time)")
    from torch.utils import cpp_extension

    try:
        with BuildProgress(announcement):
            path = cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(HERE)],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError
        _failure = (f"building kvforge's C++ kernels with {compiler} in {directory} failed: "
                    f"{failure_summary(exc)}\n{WITHOUT_LIBRARY}. Fix the toolchain (CXX names the "
                    "compiler), then retry with `kvforge build-kernels`")
        raise CppBuildError(_failure) from exc
    return str(path or cached_library() or directory)
