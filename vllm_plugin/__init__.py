"""kvforge's attention backends as vLLM's attention backend: a `vllm.general_plugins` plugin.

vLLM calls `register` in each of its processes. With `KVFORGE_VLLM_ATTENTION_BACKEND`
naming a kvforge attention backend (`cpp`, `sdpa`, `reference`, or any a plugin
registers), the adapter `backend.KvforgeAttentionBackend` takes the place of vLLM's
CPU attention backend (`CPU_ATTN`). Unset, `register` does nothing and imports
nothing, so installing kvforge next to vLLM changes nothing by itself.
"""

from __future__ import annotations

import os

BACKEND_ENV = "KVFORGE_VLLM_ATTENTION_BACKEND"
ADAPTER_PATH = "kvforge.vllm_plugin.backend.KvforgeAttentionBackend"


def chosen_backend_name(environ: dict[str, str] | None = None) -> str | None:
    """The kvforge attention backend `KVFORGE_VLLM_ATTENTION_BACKEND` names; None when unset or empty."""
    name = (os.environ if environ is None else environ).get(BACKEND_ENV, "").strip()
    return name or None


def register() -> None:
    """vLLM's general-plugin hook: put the adapter in place of `CPU_ATTN` when the variable is set.

    An unknown name fails here, at vLLM's start-up, with the valid names."""
    name = chosen_backend_name()
    if name is None:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .selection import registration_of

    registration_of(name)  # raises SelectionError listing the valid names
    register_backend(AttentionBackendEnum.CPU_ATTN, ADAPTER_PATH)
