"""The adapter: vLLM v1's attention backend interface over a kvforge attention backend.

* `KvforgeAttentionBackend` is what vLLM selects in place of `CPU_ATTN`; it reports
  the kvforge backend's dtypes, head sizes, block sizes and features.
* `KvforgeMetadataBuilder.build` runs once per step (per KV-cache group): it turns
  vLLM's `CommonAttentionMetadata` into kvforge's `AttentionBatch` and calls `plan`
  once for each distinct kvforge backend instance of its layers.
* `KvforgeAttentionImpl` is one layer: its constructor builds (or shares) the kvforge
  backend, so a configuration kvforge refuses fails at vLLM's start-up with kvforge's
  reasons; `do_kv_cache_update` is the backend's `write_kv`, `forward` its `forward`
  with the step's plan. vLLM's per-layer cache is read in the kvforge backend's own
  layout (`batch.cache_view`).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvforge.core import SLIDING_WINDOW, AttentionBackend as KvforgeBackend, AttentionBatch, AttentionLayerSpec, dtype_name
from kvforge.core.config import CacheConfig

from . import BACKEND_ENV, chosen_backend_name
from .batch import attention_batch, cache_view
from .selection import backend_for, layer_spec, refusal, registration_of

FLOAT_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
# a child of vLLM's logger, so the line shows in vLLM's log (configured once vLLM starts its engine)
log = logging.getLogger("vllm.plugins.kvforge")


@functools.cache
def announce(name: str) -> None:
    """Say once per process which kvforge backend computes vLLM's attention."""
    registration = registration_of(name)
    log.info("vLLM's CPU attention runs on kvforge attention backend %r (%s %s), set by %s", name,
             registration.distribution, registration.version, BACKEND_ENV)


def kvforge_class() -> type[KvforgeBackend]:
    """The class of the kvforge backend this process runs (`KVFORGE_VLLM_ATTENTION_BACKEND`)."""
    return registration_of(chosen_backend_name() or "").cls


class KvforgeAttentionBackend(AttentionBackend):
    """vLLM's CPU attention backend, computed by the kvforge backend the variable names."""

    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member it overrides; vLLM looks the layer's backend up by this name

    @staticmethod
    def get_impl_cls() -> type["KvforgeAttentionImpl"]:
        return KvforgeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KvforgeMetadataBuilder"]:
        return KvforgeMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # kvforge's own block size (cache.block_size's default) where the backend takes it: vLLM then
        # splits each of its blocks (128 tokens on the CPU) into blocks of that size for the kernel
        sizes, native = kvforge_class().block_sizes, CacheConfig().block_size
        return [native] if sizes is None or native in sizes else sorted(sizes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        sizes = kvforge_class().head_sizes
        return sorted(sizes) if sizes is not None else []

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in kvforge_class().dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in FLOAT_KV_CACHE_DTYPES

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return SLIDING_WINDOW in kvforge_class().features

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Each layer's blocks as dense pages in one tensor: `cache_view` reads them in kvforge's layout.
        return (KVCacheLayout.LBHNC,)


@dataclass
class KvforgeMetadata:
    """One step: kvforge's batch and, per distinct layer spec, its backend and that backend's plan."""

    batch: AttentionBatch
    plans: dict[AttentionLayerSpec, tuple[KvforgeBackend, Any]]


class KvforgeMetadataBuilder(AttentionMetadataBuilder[KvforgeMetadata]):
    reorder_batch_threshold: ClassVar[int | None] = None  # kvforge batches mix prefills and decodes in any order

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        impls = [layer.impl for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()]
        self.backends = {impl.layer: impl.bind(self.block_size) for impl in impls
                         if isinstance(impl, KvforgeAttentionImpl)}
        for backend in self.backends.values():  # vLLM's page per block must hold the backend's block exactly
            page = math.prod(type(backend).kv_cache_shape(1, backend.cache)) * backend.cache.tensor_dtype.itemsize
            if page != kv_cache_spec.page_size_bytes:
                raise refusal(backend.name, f"its block of {page} bytes differs from vLLM's page of "
                                            f"{kv_cache_spec.page_size_bytes} bytes ({kv_cache_spec})")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvforgeMetadata:
        m = common_attn_metadata
        batch = attention_batch(m.query_start_loc_cpu, m.seq_lens, m.block_table_tensor, m.slot_mapping,
                                m.num_reqs, self.block_size)
        return KvforgeMetadata(batch, {spec: (backend, backend.plan(batch)) for spec, backend in self.backends.items()})


class KvforgeAttentionImpl(AttentionImpl[KvforgeMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported: Any) -> None:
        self.name = chosen_backend_name() or ""
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        config = get_current_vllm_config()
        self.dtype = config.model_config.dtype
        reasons = []
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type!r} (the adapter runs decoder self-attention only)")
        if kv_cache_dtype not in ("auto", dtype_name(self.dtype)):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} (the adapter keeps the KV cache in the model dtype, "
                           f"{dtype_name(self.dtype)}; set kv_cache_dtype='auto')")
        if sinks is not None:
            reasons.append("attention sinks")
        reasons += [f"{key}={value!r}" for key, value in unsupported.items() if value not in (None, False)]
        if reasons:
            raise refusal(self.name, reasons)
        self.layer = layer_spec(num_heads, num_kv_heads, head_size, scale, sliding_window, logits_soft_cap,
                                alibi_slopes)
        self.backend = self.bind(config.cache_config.block_size)  # refused here, at start-up, if it must be
        announce(self.name)
        self.kv_shape: tuple[int, ...] | None = None

    def bind(self, block_size: int) -> KvforgeBackend:
        """The kvforge backend for this layer over blocks of `block_size` (the KV-cache spec's,
        known once vLLM has laid out the cache), shared with every layer of the same spec."""
        self.backend = backend_for(self.name, self.layer, self.dtype, block_size)
        return self.backend

    def kvforge_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        if self.kv_shape is None or self.kv_shape[0] != kv_cache.shape[0]:
            self.kv_shape = type(self.backend).kv_cache_shape(kv_cache.shape[0], self.backend.cache)
        return cache_view(kv_cache, self.kv_shape)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        n = min(key.shape[0], slot_mapping.shape[0])  # padded tokens carry slot -1, which write_kv skips
        self.backend.write_kv(key[:n], value[:n], self.kvforge_cache(kv_cache), slot_mapping[:n])

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KvforgeMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the kvforge adapter does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs
            return output
        backend, plan = attn_metadata.plans[self.layer]
        n = attn_metadata.batch.num_tokens
        backend.forward(query[:n], self.kvforge_cache(kv_cache), plan, out=output[:n])
        return output
