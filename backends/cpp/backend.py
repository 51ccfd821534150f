"""The `cpp` attention backend: kvforge's own C++ CPU kernel.

The kernel (`paged_attention.cpp`) is a `torch.library` custom op,
`torch.ops.kvforge_cpp.paged_attention`, that reads the paged cache straight
through the block table: tiles of (sequence, KV head, up to 64 query rows) run in
parallel, every query head sharing a KV head is handled together, and an online
softmax accumulates in float32. A quantized cache (int8, float8_e4m3fn,
float8_e5m2) is read as the two views of `quantized_kv_views` and dequantized
inside the tiles, as each block is read. `torch.ops.kvforge_cpp.write_kv` fills
a float cache; `write_quantized_kv` quantizes and fills one for kvforge's own
quantizers (bit-identical to them), and any other per-token quantizer with
those storage dtypes is written by the base class, through the quantizer.
The library is compiled on first construction and cached on disk (see `build`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.core import (
    ALIBI,
    LOGIT_SOFT_CAP,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    Availability,
    QUANTIZER,
    KVCacheSpec,
    Quantizer,
    SelectionError,
    build_registry,
)

from kvforge.kernels import build
from .quantized_views import QuantizedViews


@dataclass(frozen=True)
class CppPlan:
    """The step's batch metadata as the kernel reads it: contiguous int32 CPU tensors."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor


def as_int32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device="cpu", dtype=torch.int32).contiguous()


BUILTIN_KV_QUANTIZERS = frozenset({"int8", "fp8_e4m3", "fp8_e5m2"})
"""kvforge's own absmax KV quantizers, whose arithmetic `write_quantized_kv` repeats."""


def is_builtin_kv_quantizer(quantizer: Quantizer | None) -> bool:
    """Whether `quantizer` is exactly one of BUILTIN_KV_QUANTIZERS as the kvforge
    distribution registers it (not a subclass, not a namesake from elsewhere)."""
    if quantizer is None or quantizer.name not in BUILTIN_KV_QUANTIZERS:
        return False
    try:
        registration = build_registry().get(QUANTIZER, quantizer.name)
    except SelectionError:
        return False
    return type(quantizer) is registration.cls and registration.distribution == "kvforge"


class CppAttentionBackend(AttentionBackend):
    """Paged attention by a custom C++ CPU kernel (no gather copy, online softmax)."""

    name = "cpp"
    priority = 25  # above `sdpa` (10): faster on CPU, and passes the same conformance suite
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    quantized_kv_dtypes = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})
    features = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI})

    def __init__(self, layer: AttentionLayerSpec, cache: KVCacheSpec, device: str | torch.device = "cpu"):
        super().__init__(layer, cache, device)
        build.load()
        self.scale = float(layer.softmax_scale)
        self.window = int(layer.sliding_window or 0)
        self.soft_cap = float(layer.logit_soft_cap or 0.0)
        self.alibi = (torch.tensor(layer.alibi_slopes, dtype=torch.float32)
                      if layer.alibi_slopes is not None else None)
        self.writes_quantized_in_cpp = is_builtin_kv_quantizer(cache.quantizer)
        self.quantized_views = QuantizedViews(cache) if cache.quantized else None

    @classmethod
    def prepare(cls) -> None:
        build.load()  # raises CppBuildError naming the compiler, the command and what runs without it

    @classmethod
    def availability(cls) -> Availability:
        # Never builds just to answer: a missing toolchain is found by looking on PATH.
        if build.is_loaded() or build.cached_library() is not None:
            return Availability.yes()
        if build.failure() is not None:
            return Availability.no(build.failure())
        missing = build.missing_tools()
        return Availability.no(missing) if missing else Availability.yes()

    def plan(self, batch: AttentionBatch) -> CppPlan:
        return CppPlan(
            query_start_loc=as_int32(batch.query_start_loc),
            seq_lens=as_int32(batch.seq_lens),
            context_lens=as_int32(batch.context_lens),
            block_table=as_int32(batch.block_table),
        )

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.writes_quantized_in_cpp:
            data, scales = self.quantized_views.views(kv_cache)
            try:
                torch.ops.kvforge_cpp.write_quantized_kv(key, value, data, scales, slot_mapping.to(torch.int64))
            except RuntimeError:
                for x in (key, value):  # NaN or infinity: the quantizer's own QuantizationError
                    self.cache.quantizer.check_finite(x)
                raise
            return
        if self.cache.quantized:
            super().write_kv(key, value, kv_cache, slot_mapping)
            return
        torch.ops.kvforge_cpp.write_kv(key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache,
                                       slot_mapping.to(torch.int64))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: CppPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(query, kv_cache, plan, out, batch_invariant=False)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: CppPlan, out: torch.Tensor | None,
               batch_invariant: bool) -> torch.Tensor:
        """`forward` on the kernel's fast tiles, or its batch-invariant one (invariant_tile.h)."""
        if query.stride(-1) != 1:
            query = query.contiguous()
        target = out if out is not None and out.stride(-1) == 1 else torch.empty_like(query)
        scales = None
        if self.quantized_views is not None:
            kv_cache, scales = self.quantized_views.views(kv_cache)
        torch.ops.kvforge_cpp.paged_attention(
            query, kv_cache, plan.query_start_loc, plan.seq_lens, plan.context_lens, plan.block_table,
            self.scale, self.window, self.soft_cap, self.alibi, target, scales, batch_invariant)
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target
