"""Which kvforge attention backend serves a vLLM attention layer, judged by kvforge's
own rules (`Registry.select` and the backend's `unsupported_reasons`), and the one
instance every layer of the same shape shares."""

from __future__ import annotations

import functools

import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    AttentionBackend,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionError,
    UnsupportedConfigurationError,
    attention_request,
    build_registry,
)
from kvforge.core.registry import Registration

from . import BACKEND_ENV


@functools.cache
def registry():
    """kvforge's registry in this process, loaded once."""
    return build_registry()


def registration_of(name: str) -> Registration:
    """The registered kvforge attention backend `name`, or a SelectionError listing the valid names."""
    try:
        return registry().get(ATTENTION_BACKEND, name)
    except SelectionError as exc:
        raise SelectionError(f"{BACKEND_ENV}={name}: {exc}") from exc


def layer_spec(num_heads: int, num_kv_heads: int | None, head_size: int, scale: float,
               sliding_window: int | None = None, logits_soft_cap: float | None = None,
               alibi_slopes: list[float] | None = None) -> AttentionLayerSpec:
    """vLLM's `AttentionImpl` arguments as kvforge's layer spec. vLLM's window `W` is
    kvforge's (the last `W` positions, the query's own included); a soft-cap of 0 is none."""
    return AttentionLayerSpec(
        num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads, head_size=head_size, scale=float(scale),
        sliding_window=sliding_window if sliding_window and sliding_window > 0 else None,
        logit_soft_cap=float(logits_soft_cap) if logits_soft_cap else None,
        alibi_slopes=tuple(float(s) for s in alibi_slopes) if alibi_slopes is not None else None)


def refusal(name: str, reasons: list[str] | str) -> UnsupportedConfigurationError:
    """The start-up error for a layer kvforge's backend `name` will not serve, with its reasons."""
    text = reasons if isinstance(reasons, str) else "; ".join(reasons)
    return UnsupportedConfigurationError(
        f"{BACKEND_ENV}={name}: kvforge attention backend {name!r} cannot serve this vLLM model: {text}; "
        f"choose another kvforge backend (`kvforge plugins` lists them) or unset {BACKEND_ENV} "
        "to run vLLM's own CPU attention")


@functools.cache
def backend_for(name: str, layer: AttentionLayerSpec, dtype: torch.dtype, block_size: int) -> AttentionBackend:
    """The kvforge backend `name` for `layer` over a float KV cache of `dtype` in blocks
    of `block_size`: one instance per distinct (layer, dtype, block size), as kvforge's
    models share one per distinct spec, so one `plan` per step serves all its layers.
    Raises `refusal(...)` with the backend's reasons when it cannot serve them."""
    request = attention_request([layer], "cpu", dtype, block_size=block_size)
    try:
        cls = registry().select(ATTENTION_BACKEND, name, request, prepare=True).cls
    except SelectionError as exc:
        candidate = next((c for c in registry().candidates(ATTENTION_BACKEND, request)
                          if c.registration.name == name), None)
        raise refusal(name, candidate.why_not() if candidate is not None else str(exc)) from exc
    cache = KVCacheSpec(block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                        dtype=dtype)
    return cls(layer, cache, "cpu")
