"""The `cpp_batch_invariant` attention backend: the `cpp` kernel's batch-invariant tile.

Every query row's softmax walks its keys in tiles at fixed absolute positions,
in one fixed order of sums, so a row's output is bitwise the same alone or in
any batch, as a prefill row or as a decode, at any declared block size: what it
declares as `batch_invariant` (guarantee 8 of `AttentionBackend`). On AVX-512
(head sizes 16 to 1024 in steps of 16, at most 64 query heads per KV head) every
tile, decodes included, runs the prefill tile's arithmetic with its 48-key tiles
aligned (kernels/prefill_tile.h): tiles of up to 8 rows per KV head (decodes)
compute the same bits with keys and head dims in the lanes (kernels/narrow_rows.h),
so prompts keep the prefill tile's speed and decodes stay near the decode tile's;
with more query heads per KV head the decode tile's arithmetic with its groups of
16 keys aligned; elsewhere the portable batch-invariant tile (kernels/invariant_tile.h). It is what an engine with `batch_invariant` on selects
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
    # Multiples of 16: the portable tile's groups of 16 keys then never straddle a block, so
    # every declared block size gives the same bits (the AVX-512 prefill tile's never depend on it).
    block_sizes = frozenset(range(16, 1025, 16))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: CppPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(query, kv_cache, plan, out, batch_invariant=True)
