"""The `cpp` attention backend plugin: a custom C++ CPU kernel (see `backend`)."""

from kvforge.core import hookimpl

from .backend import CppAttentionBackend, CppPlan


@hookimpl
def kvforge_implementations():
    return [CppAttentionBackend]


__all__ = ["CppAttentionBackend", "CppPlan", "kvforge_implementations"]
