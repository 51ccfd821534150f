"""`kvforge build-kernels`: build kvforge's C++ kernels now, ahead of the first run.

`scripts/bootstrap.sh` runs it. Without it, the first process that needs the
kernels builds them (saying so on stderr); with it, that process only loads them.
"""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    parser = commands.add_parser("build-kernels", help="compile kvforge's C++ kernels into the cache now "
                                 "(the first run otherwise does it)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvforge.kernels import build

    path = build.load()  # a failure is a CppBuildError: the CLI prints it and exits 2
    print(f"kvforge's C++ kernels are ready: {path}")
    return 0
