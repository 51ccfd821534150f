"""The `flashinfer` attention backend: FlashInfer's paged prefill and decode wrappers.

FlashInfer reads our default NHD cache `[num_blocks, 2, block_size, num_kv_heads,
head_size]` as its single-tensor paged layout, without a copy. `plan` converts
the batch to FlashInfer's CSR arguments (`kvforge.core.paged_csr`) and plans a
wrapper once per step: the decode wrapper when every sequence has one new
token, else the prefill wrapper (causal, aligned bottom-right, which is exactly
"query `i` sits at position `context_len + i`"). `forward` runs it per layer.

Reads float KV, and fp8 KV from a static-scale quantizer (`cache.kv_cache_dtype =
"fp8_e4m3_per_tensor"` or `"fp8_e5m2_per_tensor"`): FlashInfer's fp8 paged kernels
take one scale for all keys and one for all values of a layer (`run(k_scale=...,
v_scale=...)` floats, folded into the softmax scale and the output), which is
what such a quantizer keeps (`KVCacheSpec.kv_scales_or_default()`, host floats:
no device sync per call). The fp8 codes are read in place from the quantized
cache's data view (`quantized_kv_views`: NHD with a page stride of the block's
row of bytes), handed over as the (keys, values) pair. A per-token quantizer
(one scale per token and KV head) is refused with that reason: its scales cannot
be folded into one float (the `triton` backend reads them).

Needs CUDA. Without it, `availability()` says so without importing flashinfer,
and `auto` never picks it. Validated only on a GPU (benchmarks/gpu_check.sh);
on CPU only the argument conversion and the calls at the wrapper boundary are
tested. The fp8 path has not been run on a GPU yet.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.core import (
    LOGIT_SOFT_CAP,
    PER_TENSOR,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    Availability,
    KVCacheSpec,
    hookimpl,
    quantized_kv_views,
)


WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by every wrapper: they run one after another."""
    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def plan_arguments(batch: AttentionBatch, layer: AttentionLayerSpec, dtype: torch.dtype,
                   kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The keyword arguments of `BatchPrefillWithPagedKVCacheWrapper.plan` for `batch`,
    queries in `dtype` over keys and values stored in `kv_dtype` (default `dtype`;
    an fp8 dtype for a quantized cache).

    The decode wrapper takes the same CSR view and options, minus `qo_indptr`,
    `causal` and the `head_dim_qk` spelling (see `decode_plan_arguments`).
    """
    csr = batch.csr_view()
    return dict(
        qo_indptr=batch.query_start_loc.to(torch.int32),
        paged_kv_indptr=csr.indptr,
        paged_kv_indices=csr.indices,
        paged_kv_last_page_len=csr.last_page_len,
        num_qo_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim_qk=layer.head_size,
        page_size=batch.block_size,
        causal=True,
        sm_scale=layer.softmax_scale,
        # FlashInfer's window is "keys up to window_left positions back", inclusive; ours counts the query too.
        window_left=layer.sliding_window - 1 if layer.sliding_window is not None else -1,
        logits_soft_cap=layer.logit_soft_cap,
        q_data_type=dtype,
        kv_data_type=kv_dtype or dtype,
    )


def decode_plan_arguments(batch: AttentionBatch, layer: AttentionLayerSpec, dtype: torch.dtype,
                          kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The keyword arguments of `BatchDecodeWithPagedKVCacheWrapper.plan` for a pure-decode batch."""
    args = plan_arguments(batch, layer, dtype, kv_dtype)
    return dict(
        indptr=args["paged_kv_indptr"], indices=args["paged_kv_indices"], last_page_len=args["paged_kv_last_page_len"],
        num_qo_heads=args["num_qo_heads"], num_kv_heads=args["num_kv_heads"], head_dim=args["head_dim_qk"],
        page_size=args["page_size"], sm_scale=args["sm_scale"], window_left=args["window_left"],
        logits_soft_cap=args["logits_soft_cap"], q_data_type=dtype, kv_data_type=args["kv_data_type"],
    )


def run_arguments(kv_cache: torch.Tensor, cache: KVCacheSpec) -> tuple[Any, dict[str, Any]]:
    """What `run` reads besides the query: the paged cache as FlashInfer takes it, and
    the keyword arguments that go with it. A float cache is the NHD tensor itself;
    a static-scale fp8 cache is the (keys, values) pair of fp8 views into its rows
    of bytes (no copy) with the layer's `k_scale` and `v_scale` as host floats."""
    if not cache.quantized:
        return kv_cache, {}
    data, _ = quantized_kv_views(kv_cache, cache)
    key_scale, value_scale = cache.kv_scales_or_default()
    return (data[:, 0], data[:, 1]), {"k_scale": key_scale, "v_scale": value_scale}


def is_pure_decode(batch: AttentionBatch) -> bool:
    return batch.max_query_len == 1


@dataclass(frozen=True)
class FlashInferPlan:
    """A wrapper planned for one step. The wrapper belongs to the backend instance:
    the next `plan` call replans it, so a plan is valid until then."""

    wrapper: Any
    decode: bool


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer's paged kernels over the NHD cache; plan once per step, run per layer."""

    name = "flashinfer"
    priority = 40
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16})
    head_sizes = frozenset({64, 128, 256})
    features = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP})
    quantized_kv_dtypes = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})  # see the module docstring
    kv_scale_granularities = frozenset({PER_TENSOR})
    quantized_kv_note = ("FlashInfer's fp8 KV kernels take one k_scale and one v_scale per layer, not "
                         "per-(token, KV head) scales: use cache.kv_cache_dtype = 'fp8_e4m3_per_tensor' (or "
                         "'fp8_e5m2_per_tensor') with FlashInfer, or attention.backend = 'triton' for a per-token "
                         "quantized KV cache")

    @classmethod
    def availability(cls) -> Availability:
        if not torch.cuda.is_available():
            return Availability.no("needs CUDA (torch sees no CUDA device; FlashInfer kernels run only on NVIDIA GPUs)")
        if importlib.util.find_spec("flashinfer") is None:
            return Availability.no("flashinfer not installed (pip install 'kvforge[flashinfer]')")
        return Availability.yes()

    def __init__(self, layer, cache, device="cuda"):
        super().__init__(layer, cache, device)
        import flashinfer  # only once a backend is built, on a CUDA machine

        buffer = workspace(self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(buffer, kv_layout="NHD")
        # Tensor cores pay off for decode once several query heads share a KV head.
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            buffer, kv_layout="NHD", use_tensor_cores=layer.queries_per_kv >= 4)

    def plan(self, batch: AttentionBatch) -> FlashInferPlan:
        kv_dtype = self.cache.storage_dtype
        if is_pure_decode(batch):
            self.decode_wrapper.plan(**decode_plan_arguments(batch, self.layer, self.cache.dtype, kv_dtype))
            return FlashInferPlan(self.decode_wrapper, decode=True)
        self.prefill_wrapper.plan(**plan_arguments(batch, self.layer, self.cache.dtype, kv_dtype))
        return FlashInferPlan(self.prefill_wrapper, decode=False)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: FlashInferPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        # Models may hand over views (q of a fused qkv projection); the kernels want dense rows.
        paged_kv, scales = run_arguments(kv_cache, self.cache)
        plan.wrapper.run(query.contiguous(), paged_kv, out=out, **scales)
        return out


@hookimpl
def kvforge_implementations():
    return [FlashInferAttentionBackend]
