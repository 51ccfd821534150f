"""The `cpp` attention backend plugin: a custom C++ CPU kernel (see `backend`), and
`cpp_batch_invariant`, the same kernel on its batch-invariant tile (see `batch_invariant`)."""

from kvforge.core import hookimpl

from .backend import CppAttentionBackend, CppPlan
from .batch_invariant import CppBatchInvariantAttentionBackend


@hookimpl
def kvforge_implementations():
    return [CppAttentionBackend, CppBatchInvariantAttentionBackend]


__all__ = ["CppAttentionBackend", "CppBatchInvariantAttentionBackend", "CppPlan", "kvforge_implementations"]
