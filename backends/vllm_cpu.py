"""The `vllm_cpu` attention backend: vLLM's own CPU paged-attention kernel
(`torch.ops._C.cpu_attention_with_kv_cache`, the kernel of vLLM's `CPU_ATTN`
backend) behind kvforge's `AttentionBackend` contract. Available where vLLM's CPU
build is installed (`vllm_cpu_ops` loads it); elsewhere it is listed unavailable
with the reason.

Layout. vLLM's CPU kernel reads each block head-major: for every KV head, the
block's keys, then its values, each `block_size * head_size` elements, and it
takes strides for blocks and heads only, so kvforge's NHD cache (heads interleaved
inside a token) cannot be read in place. This backend therefore owns its layout,
as the contract allows (`kv_layout`, `kv_cache_shape`): `[num_blocks,
num_kv_heads, 2, block_size, head_size]`, the same bytes as vLLM's `[num_blocks,
num_kv_heads, 2 * block_size, head_size]`. Inside a (block, head), the `vec` and
`vec16` kernels keep the values row-major `[block_size, head_size]` and the keys
transposed, `[head_size, block_size]` (`unpacked_kv` gives both as
`[..., block_size, head_size]` views); `write_kv` is vLLM's own
`cpu_attn_reshape_and_cache`, so the packing is always the kernel's. No conversion
runs per step.

Per step, `plan` makes the batch's index tensors int32 and contiguous (the kernel
reads raw pointers) and builds vLLM's scheduler metadata (`get_scheduler_metadata`:
how the step's work is split over this process's threads, for this layer's heads,
head size, dtype and sliding window). Layers of one spec share it. The kernel
refuses metadata built for another thread count, so a `forward` running under a
different `torch.get_num_threads()` than its `plan` builds its own (an engine
keeps one count, and never pays this).

Declared: the CPU; float32, float16, bfloat16; vLLM's head sizes (32, 64, 80, 96,
112, 128, 160, 192, 224, 256, 512); block sizes that are multiples of 16 up to 512
(the `vec16` kernel's alignment; multiples of 32 run vLLM's `vec`, or `amx` for
bfloat16 on CPUs with AMX); causal attention with sliding window, logit soft-cap
and ALiBi. A float KV cache only: vLLM's CPU fp8 KV cache is its own uint8 layout
with one scale per layer, which kvforge's quantized cache (codes and float32
scales per token in one row per block) is not. vLLM's `amx` kernel (and its key
packing), chosen only on CPUs with AMX, is not covered by the suite's record of
this backend (docs/vllm_cpu_conformance.md), which is of `vec` and `vec16`.
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
    Availability,
    KVCacheSpec,
    hookimpl,
)

from . import vllm_cpu_ops

VLLM_CPU_ATTN = "vllm_cpu_attn"
"""vLLM `CPU_ATTN`'s layout, `[num_blocks, num_kv_heads, 2, block_size, head_size]`:
per block and KV head, its keys (index 0 of dim 2), transposed, then its values
(index 1), packed as the chosen kernel reads them (see `unpacked_kv`)."""
UNPACKED_ISAS = ("vec", "vec16")  # whose packing `unpacked_kv` knows
HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
BLOCK_SIZES = frozenset(range(16, 513, 16))


def unpacked_kv(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a cache in this layout as `[num_blocks, num_kv_heads, block_size,
    head_size]` views (writing through them writes the cache), for the `vec` and `vec16`
    kernels' packing: keys stored `[head_size, block_size]`, values `[block_size, head_size]`."""
    if isa not in UNPACKED_ISAS:
        raise NotImplementedError(f"unpacked_kv knows the key packing of the {' and '.join(UNPACKED_ISAS)} kernels, "
                                  f"not {isa!r}'s")
    num_blocks, kv_heads, _, block_size, head_size = kv_cache.shape
    keys = kv_cache[:, :, 0].view(num_blocks, kv_heads, head_size, block_size).transpose(2, 3)
    return keys, kv_cache[:, :, 1]


@dataclass(frozen=True)
class VllmCpuPlan:
    """One step's arguments of `cpu_attention_with_kv_cache`, shared by the layers of one spec."""

    query_start_loc: torch.Tensor  # int32, contiguous
    seq_lens: torch.Tensor  # int32, contiguous
    block_table: torch.Tensor  # int32, rows contiguous
    scheduler_metadata: torch.Tensor  # sized for `threads`
    threads: int  # torch.get_num_threads() when planned


class VllmCpuAttentionBackend(AttentionBackend):
    """vLLM's CPU attention kernel over its own head-major paged layout."""

    name = "vllm_cpu"
    priority = 5  # below kvforge's own CPU backends: chosen by name, not by `auto`
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    head_sizes = HEAD_SIZES
    block_sizes = BLOCK_SIZES
    features = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI})
    quantized_kv_dtypes = frozenset()
    quantized_kv_note = ("vLLM's CPU kernel reads fp8 KV only in its own uint8 layout with one scale per layer, "
                         "not kvforge's quantized cache; use attention.backend = 'cpp' for a quantized KV cache")
    kv_layout = VLLM_CPU_ATTN

    @classmethod
    def availability(cls) -> Availability:
        return vllm_cpu_ops.load()

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, cache: KVCacheSpec) -> tuple[int, ...]:
        return (num_blocks, cache.num_kv_heads, 2, cache.block_size, cache.head_size)

    def __init__(self, layer, cache, device="cpu"):
        super().__init__(layer, cache, device)
        availability = vllm_cpu_ops.load()
        if not availability.ok:
            raise RuntimeError(f"attention backend 'vllm_cpu' is unavailable: {availability.reason}")
        self.ops = torch.ops._C
        self.isa = vllm_cpu_ops.attention_isa(cache.dtype, cache.block_size, layer.head_size)
        self.window = layer.sliding_window if layer.sliding_window is not None else -1
        self.soft_cap = float(layer.logit_soft_cap) if layer.logit_soft_cap is not None else 0.0
        self.alibi_slopes = (torch.tensor(layer.alibi_slopes, dtype=torch.float32)
                             if layer.alibi_slopes is not None else None)

    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = unpacked_kv(kv_cache, self.isa)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def scheduler_metadata(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """vLLM's split of one step's work over this process's current thread count."""
        return self.ops.get_scheduler_metadata(
            seq_lens.shape[0], self.layer.num_heads, self.layer.num_kv_heads, self.layer.head_size, seq_lens,
            self.cache.dtype, query_start_loc, True, self.window, self.isa, True, None, "auto")

    def plan(self, batch: AttentionBatch) -> VllmCpuPlan:
        query_start_loc = batch.query_start_loc.to(torch.int32).contiguous()
        seq_lens = batch.seq_lens.to(torch.int32).contiguous()
        return VllmCpuPlan(query_start_loc, seq_lens, batch.block_table.to(torch.int32).contiguous(),
                           self.scheduler_metadata(query_start_loc, seq_lens), torch.get_num_threads())

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if key.shape[0] == 0:
            return
        dtype = kv_cache.dtype
        self.ops.cpu_attn_reshape_and_cache(
            key.to(dtype).contiguous(), value.to(dtype).contiguous(), kv_cache[:, :, 0], kv_cache[:, :, 1],
            slot_mapping.to(torch.int64).contiguous(), self.isa, 1.0, 1.0, "auto")

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: VllmCpuPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        metadata = plan.scheduler_metadata
        if torch.get_num_threads() != plan.threads:  # the kernel refuses metadata sized for other threads
            metadata = self.scheduler_metadata(plan.query_start_loc, plan.seq_lens)
        direct = out.is_contiguous() and out.dtype == kv_cache.dtype
        target = out if direct else torch.empty(query.shape, dtype=kv_cache.dtype)
        self.ops.cpu_attention_with_kv_cache(
            query.to(kv_cache.dtype).contiguous(), kv_cache[:, :, 0], kv_cache[:, :, 1], target,
            plan.query_start_loc, plan.seq_lens, self.layer.softmax_scale, True, self.alibi_slopes, self.window,
            plan.block_table, self.soft_cap, metadata, None, None, 1.0, 1.0, "auto")
        if not direct:
            out.copy_(target)
        return out


@hookimpl
def kvforge_implementations():
    return [VllmCpuAttentionBackend]
