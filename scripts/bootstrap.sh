#!/usr/bin/env bash
# Create .venv and install kvforge with its test tools, never letting the resolver
# swap torch for a multi-GB CUDA build on a machine without a GPU; then build
# kvforge's C++ kernels (about 1-2 minutes on 2 CPU cores), so that the first
# `kvforge generate` only loads them.
#
#   KVFORGE_VENV        where to create the environment (default: .venv)
#   KVFORGE_TORCH       the torch requirement (default: torch==2.13.0)
#   KVFORGE_TORCH_INDEX extra pip arguments for torch alone, e.g.
#                       "--index-url https://download.pytorch.org/whl/cpu" on a machine
#                       without a GPU and without a local CPU wheel
#   KVFORGE_EXTRAS      pip extras to install (default: test,triton,docs,serve,ray,structured)
#   KVFORGE_BUILD_KERNELS=0  skip the kernel build (the first process that needs them builds them)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVFORGE_VENV:-.venv}"
torch_req="${KVFORGE_TORCH:-torch==2.13.0}"
extras="${KVFORGE_EXTRAS:-test,triton,docs,serve,ray,structured}"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install --quiet --disable-pip-version-check setuptools wheel

# torch first, alone, pinned: every later install is constrained to exactly this build.
# shellcheck disable=SC2086
"$py" -m pip install --quiet --disable-pip-version-check "$torch_req" numpy ${KVFORGE_TORCH_INDEX:-}
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$py" -c 'import torch; print(f"torch=={torch.__version__}")' > "$constraints"

"$py" -m pip install --quiet --disable-pip-version-check -c "$constraints" -e ".[${extras}]"

kernels="not built (KVFORGE_BUILD_KERNELS=0)"
if [ "${KVFORGE_BUILD_KERNELS:-1}" != 0 ]; then
    # A failed build leaves a working environment (torch ops and the sdpa backend), so it is
    # reported, not fatal: the error above says which command failed and what runs without them.
    if "$venv/bin/kvforge" build-kernels; then
        kernels="ready"
    else
        kernels="FAILED to build (see the error above; kvforge runs without them)"
    fi
fi

"$py" - "$kernels" <<'PY'
import sys

import torch
gpu = torch.cuda.is_available()
print(f"kvforge environment ready: torch {torch.__version__} ({'CUDA' if gpu else 'CPU'}); "
      f"C++ kernels {sys.argv[1]}")
PY
