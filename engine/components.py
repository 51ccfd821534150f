"""Build an engine's parts from an `EngineConfig`, every implementation chosen
through the registry (`Registry.select`), never imported by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    QUANTIZER,
    SCHEDULER_POLICY,
    EngineConfig,
    Registry,
    SelectionRequest,
    UnsupportedConfigurationError,
)

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelShape:
    """What backend selection needs to know about a model before it is loaded."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    features: frozenset[str] = frozenset()


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedConfigurationError("device 'cuda' was asked for but CUDA is not available; "
                                            "set device = 'cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def model_shape(name_or_path: str) -> ModelShape:
    """Heads, head size and attention features (sliding window, soft-cap, ALiBi) of
    the model's layers, read without loading weights; empty when they cannot be
    read (then `load_model` raises the precise error)."""
    from kvforge.models.loader import attention_specs

    try:
        specs = attention_specs(name_or_path)
    except Exception:  # noqa: BLE001 - any failure here resurfaces, explained, in load_model
        return ModelShape()
    if not specs:
        return ModelShape()
    first = specs[0]
    features = frozenset().union(*(spec.required_features() for spec in specs))
    return ModelShape(first.num_heads, first.num_kv_heads, first.head_size, features)


def select_backend(registry: Registry, config: EngineConfig, shape: ModelShape, device: torch.device,
                   dtype: torch.dtype) -> type:
    request = SelectionRequest(device=device.type, dtype=dtype, kv_cache_dtype=config.cache.kv_cache_dtype,
                               head_size=shape.head_size, block_size=config.cache.block_size,
                               num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, features=shape.features)
    return registry.select(ATTENTION_BACKEND, config.attention.backend, request).cls


def build_allocator(registry: Registry, config: EngineConfig, num_blocks: int):
    cache = config.cache
    request = SelectionRequest(block_size=cache.block_size, prefix_caching=cache.enable_prefix_caching or None)
    cls = registry.select(BLOCK_ALLOCATOR, cache.allocator, request).cls
    return cls(num_blocks, cache.block_size, hash_algorithm=cache.hash_algorithm, hash_seed=config.seed)


def weight_quantizer(registry: Registry, config: EngineConfig):
    """An instance of the quantizer named by `quantization.weights` (None when unset), or
    an error naming the quantizers the int8 linear layers can run."""
    from kvforge.models.quantized_linear import int8_linear_unsupported

    name = config.quantization.weights
    if name is None:
        return None
    qualifying = [r.name for r in registry.implementations(QUANTIZER) if int8_linear_unsupported(r.cls) is None]
    if name == "auto":
        raise UnsupportedConfigurationError(
            f"quantization.weights = 'auto' is not a choice: name the weight quantizer; qualifying: "
            f"{', '.join(qualifying) or 'none installed'}")
    cls = registry.select(QUANTIZER, name).cls
    reason = int8_linear_unsupported(cls)
    if reason is not None:
        raise UnsupportedConfigurationError(
            f"quantization.weights = {name!r}: {reason}; quantizers that qualify: {', '.join(qualifying) or 'none'} "
            "(KV-cache quantizers such as 'int8' or 'fp8_e4m3' belong in cache.kv_cache_dtype)")
    return cls()


def build_policy(registry: Registry, config: EngineConfig):
    return registry.select(SCHEDULER_POLICY, config.scheduler.policy).cls()


def num_blocks(config: EngineConfig, spec, device: torch.device, max_model_len: int) -> int:
    """`cache.num_blocks` if set, otherwise sized by `cache_sizing` on `device`,
    capped at what the scheduler could ever fill (every sequence at full context)."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    from .cache_sizing import num_blocks_for

    most = config.scheduler.max_num_seqs * -(-max_model_len // config.cache.block_size)
    return num_blocks_for(config.cache, spec, device=device, max_blocks=most)


def check_supported(config: EngineConfig, dtype: torch.dtype) -> None:
    """Refuse, with the reason, settings the reference engine does not implement."""
    kv_dtype = config.cache.kv_cache_dtype
    if kv_dtype != "auto" and DTYPES.get(kv_dtype) != dtype:
        raise UnsupportedConfigurationError(
            f"cache.kv_cache_dtype = {kv_dtype!r} differs from the model dtype {str(dtype).removeprefix('torch.')}; "
            "the reference engine keeps the KV cache in the model dtype; set cache.kv_cache_dtype = 'auto'")
    if config.speculative.proposer is not None:
        raise UnsupportedConfigurationError(
            "speculative.proposer is set, but the reference engine does not run speculative decoding yet; "
            "unset speculative.proposer")
