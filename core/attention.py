"""The `attention_backend` interface and the data it exchanges (the paged KV
cache it reads and writes is laid out in `kv_cache`).

One step of the engine is one ragged batch: the new tokens of every scheduled
sequence, flattened, with no padding. A sequence contributes `query_len` tokens
(a whole prompt, a prefill chunk, one decode token, or a decode token plus
drafts); its keys and values before this step already sit in the paged cache.

Positions and masking, for every backend: query token `i` of sequence `b` sits
at absolute position `p = context_lens[b] + i` and attends to the cached keys at
positions `0..p` (causal). With a sliding window `W` it attends only to the
positions `p - W + 1 .. p`. With a logit soft-cap `c`, scaled scores `s` become
`c * tanh(s / c)`. With ALiBi, head `h` adds `slope[h] * (key_pos - p)`.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .api import ATTENTION_BACKEND
from .dtypes import dtype_name
from .implementation import Implementation, SelectionRequest
from .kv_cache import NHD, KVCacheSpec, PagedCSR, paged_csr, write_kv_by_slot, write_quantized_kv_by_slot
from .quantizer import PER_TENSOR, PER_TOKEN, Quantizer

SLIDING_WINDOW = "sliding_window"
LOGIT_SOFT_CAP = "logit_soft_cap"
ALIBI = "alibi"
FEATURES = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI})


@dataclass(frozen=True)
class AttentionLayerSpec:
    """The attention of one layer: everything a backend needs besides the data.

    `scale` multiplies `q · k` before the soft-cap, ALiBi and the softmax; None
    (the usual case) means the standard `head_size ** -0.5`, and a model sets it
    only when it uses another one. Backends read `softmax_scale`, never `scale`.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float | None = None  # None means head_size ** -0.5
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None

    @property
    def softmax_scale(self) -> float:
        """The scale to apply: `scale`, or `head_size ** -0.5` when it is None."""
        return self.scale if self.scale is not None else self.head_size ** -0.5

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def required_features(self) -> frozenset[str]:
        wanted = set()
        if self.sliding_window is not None:
            wanted.add(SLIDING_WINDOW)
        if self.logit_soft_cap is not None:
            wanted.add(LOGIT_SOFT_CAP)
        if self.alibi_slopes is not None:
            wanted.add(ALIBI)
        return frozenset(wanted)


def attention_request(layers: Sequence[AttentionLayerSpec], device: str | None, dtype: torch.dtype | None, *,
                      block_size: int | None = None, kv_storage_dtype: torch.dtype | None = None,
                      kv_scale_granularity: str | None = None) -> SelectionRequest:
    """What an attention backend is asked when it is to serve `layers`: the first
    one's heads and head size, every one's features, over a KV cache of `dtype`
    (`kv_storage_dtype` when quantized, with `kv_scale_granularity` per_token or
    per_tensor; None for a float cache; `kv_cache_request` fills both). `layers` may be
    empty when the model's shape is not known yet. The one place a request is
    built from layers: backends, models, the conformance suite, benchmarks and the
    CLI all call this."""
    first = layers[0] if layers else None
    return SelectionRequest(
        device=device, dtype=dtype, block_size=block_size,
        head_size=first.head_size if first else None,
        num_heads=first.num_heads if first else None,
        num_kv_heads=first.num_kv_heads if first else None,
        features=frozenset().union(*(layer.required_features() for layer in layers)),
        kv_storage_dtype=kv_storage_dtype, kv_scale_granularity=kv_scale_granularity)


def kv_cache_request(quantizer: Quantizer | None) -> dict[str, Any]:
    """The KV-cache fields of `attention_request` for a cache quantized by `quantizer`
    (None: a float cache): its storage dtype and how its scales come."""
    if quantizer is None:
        return {"kv_storage_dtype": None, "kv_scale_granularity": None}
    return {"kv_storage_dtype": quantizer.storage_dtype,
            "kv_scale_granularity": PER_TENSOR if quantizer.static_scale else PER_TOKEN}


@dataclass
class AttentionBatch:
    """The ragged batch of one step. Tensors live on the compute device.

    * `query_start_loc` int32 `[num_seqs + 1]`: sequence `b`'s new tokens are
      rows `query_start_loc[b]:query_start_loc[b+1]` of the flat query.
    * `seq_lens` int32 `[num_seqs]`: tokens in the cache once this step's keys
      are written (context plus new tokens).
    * `context_lens` int32 `[num_seqs]`: tokens cached before this step.
    * `block_table` int32 `[num_seqs, max_blocks]`: logical to physical block;
      entries past a sequence's last block are 0 and never read.
    * `slot_mapping` int64 `[num_tokens]`: where each new token's key and value
      go, `block * block_size + offset`; -1 means "do not write".
    * `max_query_len`, `max_seq_len`: host integers, so no backend has to sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def csr_view(self) -> "PagedCSR":
        return paged_csr(self.block_table, self.seq_lens, self.block_size)


class AttentionBackend(Implementation):
    """An attention kernel over the paged KV cache.

    Guarantees every implementation keeps (the conformance suite checks each):

      1. `unsupported_reasons` refuses, with reasons, every configuration outside
         its declared devices, dtypes, KV-cache dtypes, head sizes, block sizes
         and features; the constructor raises `UnsupportedConfigurationError`
         with the same reasons. A declared configuration is never computed wrongly.
      2. `write_kv` stores each token's key and value exactly at the slot its
         `slot_mapping` entry names, skips entries equal to -1, and touches no
         other slot of the cache.
      3. `forward` returns, for every new token, the attention over the cached
         keys and values as defined in this module's docstring, matching a
         float64 reference within 1e-5 (float32), 2e-3 (float16), 1e-2 (bfloat16)
         relative error; every output element is written and finite.
      4. `plan` is called once per step with that step's batch; its result is
         reused by `forward` for every layer and is not modified by it.
      5. Physical block ids may be in any order; blocks never referenced by the
         block table are never read.
      6. With a quantized KV cache (`cache.quantizer`, a storage dtype in
         `quantized_kv_dtypes`), `write_kv` stores what the quantizer returns and
         `forward` attends over the dequantized keys and values (`data * scale`),
         matching the float64 reference over those dequantized values within
         guarantee 3's tolerance. A static-scale quantizer (one scale per layer
         for keys and one for values, `KVCacheSpec.kv_scales_or_default()`) fills
         every written slot's scale with its tensor's constant; a backend serves
         it if `kv_scale_granularities` holds `per_tensor`.
      7. `with_kv_scales(scales)` returns a backend for one layer's static scales
         that shares everything else with this one: a `plan` of either serves both.
      8. A backend declaring `batch_invariant` gives every query row an output that
         is bitwise a function of that row alone (its query, position, and the keys
         and values it attends to): the same bits whatever other sequences share the
         step, however its sequence's query is chunked (a prefill row equals the
         same row as a decode), and whatever the cache's block size.
    """

    kind: ClassVar[str] = ATTENTION_BACKEND
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    quantized_kv_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    """Storage dtypes of a quantized KV cache (per-(token, KV head) float32 scales,
    the layout of `quantized_kv_views`) this backend reads; empty: float KV only."""
    quantized_kv_note: ClassVar[str] = ""
    """Why it reads no (other) quantized KV and what to use instead; added to that refusal."""
    kv_scale_granularities: ClassVar[frozenset[str]] = frozenset({PER_TOKEN, PER_TENSOR})
    """How the scales of a quantized KV cache it reads may come: `per_token` (a scale per
    token and KV head, read from the scale slots) and `per_tensor` (a static-scale
    quantizer's constants, which sit in those same slots, so a backend reading the
    slots reads both: the default). A backend that takes one scale per tensor instead
    (FlashInfer) declares only `per_tensor`."""
    head_sizes: ClassVar[frozenset[int] | None] = None  # None: any head size
    block_sizes: ClassVar[frozenset[int] | None] = None  # None: any block size
    features: ClassVar[frozenset[str]] = frozenset()
    kv_layout: ClassVar[str] = NHD
    batch_invariant: ClassVar[bool] = False
    """Whether it keeps guarantee 8 (each row's output bitwise independent of the batch,
    the query's chunking and the block size); an engine with `batch_invariant` on
    selects only backends that declare it."""

    def __init__(self, layer: AttentionLayerSpec, cache: KVCacheSpec, device: str | torch.device = "cpu"):
        from .errors import UnsupportedConfigurationError

        request = attention_request([layer], torch.device(device).type, cache.dtype, block_size=cache.block_size,
                                    **kv_cache_request(cache.quantizer))
        reasons = self.unsupported_reasons(request)
        if reasons:
            raise UnsupportedConfigurationError(
                f"attention backend {self.name!r} cannot serve this layer: " + "; ".join(reasons)
            )
        self.layer = layer
        self.cache = cache
        self.device = torch.device(device)

    @classmethod
    def unsupported_reasons(cls, request: SelectionRequest) -> list[str]:
        reasons = []
        if request.device is not None and request.device not in cls.devices:
            reasons.append(f"device {request.device!r} not in {sorted(cls.devices)}")
        if request.dtype is not None and request.dtype not in cls.dtypes:
            reasons.append(f"dtype {request.dtype} not in {sorted(str(d) for d in cls.dtypes)}")
        if request.kv_storage_dtype is not None and request.kv_storage_dtype not in cls.quantized_kv_dtypes:
            reads = sorted(dtype_name(d) for d in cls.quantized_kv_dtypes) or "none"
            note = f"; {cls.quantized_kv_note}" if cls.quantized_kv_note else ""
            reasons.append(f"cannot read a KV cache quantized to {dtype_name(request.kv_storage_dtype)} "
                           f"(quantized KV dtypes it reads: {reads}){note}")
        elif request.kv_storage_dtype is not None:
            granularity = request.kv_scale_granularity or PER_TOKEN
            if granularity not in cls.kv_scale_granularities:
                note = f"; {cls.quantized_kv_note}" if cls.quantized_kv_note else ""
                reasons.append(f"cannot read a KV cache quantized with {granularity} scales (it reads "
                               f"{' or '.join(sorted(cls.kv_scale_granularities))} ones){note}")
        if request.head_size is not None and cls.head_sizes is not None and request.head_size not in cls.head_sizes:
            reasons.append(f"head size {request.head_size} not in {sorted(cls.head_sizes)}")
        if request.block_size is not None and cls.block_sizes is not None and request.block_size not in cls.block_sizes:
            reasons.append(f"block size {request.block_size} not in {sorted(cls.block_sizes)}")
        if request.batch_invariant and not cls.batch_invariant:
            reasons.append("does not declare batch_invariant (a row's output may depend on the rest of the batch)")
        missing = set(request.features) - set(cls.features)
        if missing:
            reasons.append(f"features {sorted(missing)} not supported (has {sorted(cls.features) or 'none'})")
        if request.num_heads and request.num_kv_heads and request.num_heads % request.num_kv_heads:
            reasons.append(f"{request.num_heads} query heads is not a multiple of {request.num_kv_heads} KV heads")
        return reasons

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {
            "devices": sorted(cls.devices),
            "dtypes": sorted(dtype_name(d) for d in cls.dtypes),
            "kv_cache_dtypes": ["auto", *sorted(dtype_name(d) for d in cls.quantized_kv_dtypes)],
            "kv_scale_granularities": sorted(cls.kv_scale_granularities) if cls.quantized_kv_dtypes else [],
            "head_sizes": sorted(cls.head_sizes) if cls.head_sizes is not None else "any",
            "block_sizes": sorted(cls.block_sizes) if cls.block_sizes is not None else "any",
            "features": sorted(cls.features),
            "kv_layout": cls.kv_layout,
            "batch_invariant": cls.batch_invariant,
        }

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, cache: KVCacheSpec) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (dtype `cache.tensor_dtype`): NHD, or
        one row of bytes per block when quantized. Override only for another layout."""
        if cache.quantized:
            return (num_blocks, cache.layer_block_bytes())
        return (num_blocks, 2, cache.block_size, cache.num_kv_heads, cache.head_size)

    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's float cache as (keys, values), each a view `[num_blocks, block_size,
        num_kv_heads, head_size]` (writing through them writes the cache), whatever the
        layout: how the conformance suite reads what `write_kv` stored. A backend with
        its own `kv_layout` overrides it; a quantized cache is read with `quantized_kv_views`."""
        if self.kv_layout != NHD:
            raise NotImplementedError(f"{type(self).__name__} declares kv_layout {self.kv_layout!r} "
                                      "but does not say how to read it: override kv_views")
        return kv_cache[:, 0], kv_cache[:, 1]

    def with_kv_scales(self, kv_scales: tuple[float, float]) -> "AttentionBackend":
        """This backend for a layer whose static-scale KV cache has `kv_scales` (key
        scale, value scale). The default is a shallow copy with only `cache` replaced,
        so plans, wrappers and buffers stay shared and a plan of either serves both;
        a backend keeping state derived from the scales overrides it."""
        view = copy.copy(self)
        view.cache = dataclasses.replace(self.cache, kv_scales=(float(kv_scales[0]), float(kv_scales[1])))
        return view

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> Any:
        """Do the shape-dependent work for one step; the result goes to `forward`."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `key`/`value` (`[num_tokens, num_kv_heads, head_size]`) at their slots,
        quantized by `self.cache.quantizer` when there is one. The default does it in
        plain PyTorch (`write_kv_by_slot`, or `write_quantized_kv_by_slot` for a
        quantized cache) in the NHD layout; a backend with its own write kernel or
        another layout overrides it, and may hand the quantized case back to this
        default with `super().write_kv(...)`."""
        if self.cache.quantized:
            write_quantized_kv_by_slot(key, value, kv_cache, slot_mapping, self.cache)
        else:
            write_kv_by_slot(key, value, kv_cache, slot_mapping)

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for `query` (`[num_tokens, num_heads, head_size]`) over the cache,
        after this step's keys were written. Writes into `out` when given and returns it."""
