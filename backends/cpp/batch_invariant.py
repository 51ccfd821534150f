"""The `cpp_batch_invariant` attention backend: the `cpp` kernel's batch-invariant tile.

Every query row's softmax walks its keys in groups of 16 at fixed absolute
positions, in one fixed order of sums, so a row's output is bitwise the same
alone or in any batch, as a prefill row or as a decode, at any declared block
size: what it declares as `batch_invariant` (guarantee 8 of `AttentionBackend`).
On AVX-512 every tile runs the decode tile's arithmetic (kernels/decode_tile.h,
groups aligned), so decodes cost what they cost under `cpp` and prompts lose the
prefill tile; elsewhere, or with soft-cap or ALiBi or a head size that is not a
multiple of 16, the portable batch-invariant tile (kernels/invariant_tile.h). It is what an engine with `batch_invariant` on selects
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
    # Multiples of 16: the kernel's groups of 16 keys then never straddle a block, so every
    # declared block size gives the same bits (on AVX-512 it runs the decode tile's arithmetic).
    block_sizes = frozenset(range(16, 1025, 16))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: CppPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(query, kv_cache, plan, out, batch_invariant=True)
