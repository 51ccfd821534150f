"""Planted bugs: deliberately broken implementations of every kind, one bug each, the
bug in the class's docstring. They prove the conformance suite can fail, twice over:

* the tests of each kind (tests/test_attention_conformance.py, test_block_allocators.py,
  test_block_allocator_planted_bugs.py, test_quantizer_conformance.py,
  test_speculative_proposer_conformance.py, test_structured_output_conformance.py,
  test_conformance_cli.py) call the one check
  written for a bug and match its message;
* `python -m tests.planted` runs the whole suite, as `kvforge conformance --quick`, on
  every planted bug at once, registered as the plugin `planted` (this module's
  `kvforge_implementations`), and prints caught/planted per kind;
  tests/test_planted_bugs.py asserts every one is caught, each within its time limit.

Nothing installs the `planted` plugin: `expose` makes it discoverable for one process.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvforge.core import (
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    QUANTIZER,
    SCHEDULER_POLICY,
    SPECULATIVE_PROPOSER,
    STRUCTURED_OUTPUT,
    hookimpl,
)

from . import (
    attention_backends,
    block_allocators,
    quantizers,
    scheduler_policies,
    speculative_proposers,
    structured_outputs,
)

PLUGIN = "planted"
DISTRIBUTION = "kvforge-planted-bugs"
REPO = Path(__file__).resolve().parents[2]

PLANTED: dict[str, list[type]] = {
    ATTENTION_BACKEND: attention_backends.PLANTED,
    BLOCK_ALLOCATOR: block_allocators.PLANTED,
    SCHEDULER_POLICY: scheduler_policies.PLANTED,
    QUANTIZER: quantizers.PLANTED,
    SPECULATIVE_PROPOSER: speculative_proposers.PLANTED,
    STRUCTURED_OUTPUT: structured_outputs.PLANTED,
}


@hookimpl
def kvforge_implementations():
    return [cls for classes in PLANTED.values() for cls in classes]


def expose(site: Path) -> dict[str, str]:
    """Write into the directory `site` a distribution whose `kvforge.plugins` entry point
    `planted` names this package, as `pip install` would; return the environment a
    `kvforge` or `pytest` process needs to discover it (`site` and the repository on
    PYTHONPATH)."""
    info = site / f"{DISTRIBUTION.replace('-', '_')}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[kvforge.plugins]\n{PLUGIN} = {__name__}\n")
    paths = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}
