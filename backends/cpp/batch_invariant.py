"""The `cpp_batch_invariant` attention backend: the `cpp` kernel's batch-invariant tile.

Every query row's softmax walks its keys in steps of 16 at fixed absolute
positions, in one fixed order of sums (kernels/invariant_tile.h), so a row's
output is bitwise the same alone or in any batch, as a prefill row or as a
decode, at any block size: what it declares as `batch_invariant` (guarantee 8
of `AttentionBackend`). It is what an engine with `batch_invariant` on selects
under `auto`; its cost against `cpp`: docs/determinism.md.
"""

from __future__ import annotations

import torch

from .backend import CppAttentionBackend, CppPlan


class CppBatchInvariantAttentionBackend(CppAttentionBackend):
    """The `cpp` backend with every tile on the batch-invariant kernel."""

    name = "cpp_batch_invariant"
    priority = 20  # below `cpp` (25): `auto` takes it only when batch invariance is asked for
    batch_invariant = True

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: CppPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(query, kv_cache, plan, out, batch_invariant=True)
