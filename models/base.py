"""The `CausalLM` contract and the paged attention every architecture shares (the
layers they build from are in `layers.py`).

A model runs one ragged batch per step: `input_ids` and `positions` are the
flattened new tokens of every scheduled sequence (no padding), and attention
goes through an `AttentionBackend` over the paged KV cache. The caller (an
engine, or a test driver) owns the cache tensors and the `AttentionBatch`:

    caches = model.allocate_kv_cache(num_blocks, block_size)
    plan = model.plan(batch)                   # once per step
    hidden = model.forward(input_ids, positions, caches, plan)
    logits = model.compute_logits(hidden[last_rows])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core import (
    PER_TENSOR,
    PER_TOKEN,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    Quantizer,
    SelectionRequest,
    StaticScaleQuantizer,
    attention_request,
    kv_cache_request,
)
from kvforge.core.errors import ConfigError, UnsupportedConfigurationError
from .huge_pages import zeros_on_huge_pages
from .output_rows import output_rows_batch


class ModelConfig(dict):
    """A model's `config.json` as a dict, with `get` that also treats None as missing."""

    def value(self, key: str, default: Any = None) -> Any:
        found = self.get(key)
        return default if found is None else found

    def eos_token_id(self) -> int | None:
        eos = self.get("eos_token_id")
        if isinstance(eos, list):
            return int(eos[0]) if eos else None
        return None if eos is None else int(eos)


def backend_request(layers: Sequence[AttentionLayerSpec], device: str, dtype: torch.dtype | None, *,
                    block_size: int | None = None, kv_quantizer: Quantizer | None = None) -> SelectionRequest:
    """`kvforge.core.attention_request` for a KV cache quantized by `kv_quantizer`
    (None: a float cache)."""
    return attention_request(layers, device, dtype, block_size=block_size, **kv_cache_request(kv_quantizer))


def check_kv_quantizer(quantizer: type[Quantizer] | Quantizer, qualifying: Sequence[str] | None = None) -> None:
    """Refuse a quantizer that cannot quantize a KV cache: the KV layout keeps one
    scale per (token, KV head), so only a `per_token` quantizer or a static-scale
    one (its constant in every slot) fits. `qualifying` (names of the registered
    ones that do) goes into the message when given."""
    if quantizer.kv_capable():
        return
    what_next = "use a per_token or static-scale quantizer for the KV cache, or none"
    if qualifying is not None:
        what_next = (f"quantizers that qualify: {', '.join(qualifying) or 'none registered'}; "
                     "set cache.kv_cache_dtype to one of those, or to 'auto'")
    raise ConfigError(
        f"quantizer {quantizer.name!r} has granularity {quantizer.granularity!r}, but a KV cache needs a "
        f"{PER_TOKEN!r} quantizer or a static-scale {PER_TENSOR!r} one: the KV layout keeps one scale per "
        f"token and KV head; {what_next}")


KV_CALIBRATION_HEADROOM = 2.0
"""`cache.kv_scales = "calibrate"`: a layer's first prefill's largest key (value) lands at
half the fp8 range, so later ones up to twice as large still fit (vLLM's
calculate_kv_scales divides by 200 and 100 of e4m3's 448: headroom 2.2 and 4.5)."""


def calibrated_kv_scales(quantizer: StaticScaleQuantizer, key: torch.Tensor, value: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[float, float]:
    """A layer's (key scale, value scale) from the tokens of its first write (those
    with a slot, at least one): the one device sync calibration costs, once per layer."""
    keep = slot_mapping >= 0
    key, value = key[keep].detach(), value[keep].detach()
    for x in (key, value):
        quantizer.check_finite(x)
    key_amax, value_amax = torch.stack([key.abs().amax(), value.abs().amax()]).float().tolist()
    return (quantizer.calibrated_scale(key_amax, KV_CALIBRATION_HEADROOM),
            quantizer.calibrated_scale(value_amax, KV_CALIBRATION_HEADROOM))


@dataclass
class ModelPlan:
    """One step's batch and, per distinct layer spec, its backend and that backend's plan.

    When the step needs the hidden states of some rows only (`CausalLM.plan`'s
    `output_rows`), `last_layer` is the plan of the model's last layer: the same
    batch for writing keys and values, `rows` for everything after (attention
    output, projections, MLP), and backend plans over those rows (output_rows.py).
    """

    batch: AttentionBatch
    backends: dict[AttentionLayerSpec, tuple[AttentionBackend, Any]] = field(default_factory=dict)
    rows: torch.Tensor | None = None  # the rows of `batch` this plan's layer computes past its KV write
    last_layer: ModelPlan | None = None

    def for_last_layer(self) -> ModelPlan:
        """The plan the model's last layer runs with."""
        return self.last_layer or self

    def select(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """`x`'s rows this plan's layer computes (all of them without `rows`)."""
        return x if self.rows is None or x is None else x[self.rows]


class PagedAttention(nn.Module):
    """One layer's attention over its paged cache; holds no weights, only its spec,
    and, with a static-scale KV quantizer built uncalibrated (`cache.kv_scales =
    "calibrate"`), this layer's key and value scales once its first write set them."""

    def __init__(self, spec: AttentionLayerSpec):
        super().__init__()
        self.spec = spec
        self.kv_scales: tuple[float, float] | None = None  # fixed by the first write, then kept
        self._scaled: tuple[AttentionBackend, AttentionBackend] | None = None  # (shared backend, this layer's view)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                plan: ModelPlan) -> torch.Tensor:
        backend, backend_plan = plan.backends[self.spec]
        quantizer = backend.cache.quantizer
        if quantizer is not None and quantizer.static_scale and not quantizer.calibrated:
            backend = self.calibrated_backend(backend, k, v, plan.batch.slot_mapping)
        backend.write_kv(k, v, kv_cache, plan.batch.slot_mapping)
        if plan.rows is None:
            return backend.forward(q, kv_cache, backend_plan)
        if plan.rows.numel() == 0:  # a step that samples nothing (prompt chunks only): the write was all
            return q[:0]
        return backend.forward(q[plan.rows], kv_cache, backend_plan)

    def calibrated_backend(self, backend: AttentionBackend, k: torch.Tensor, v: torch.Tensor,
                           slot_mapping: torch.Tensor) -> AttentionBackend:
        """`backend` for this layer's scales, calibrated on the first write that has tokens."""
        if self.kv_scales is None:
            if not bool((slot_mapping >= 0).any()):
                return backend  # nothing written: its own error if it is asked to quantize
            self.kv_scales = calibrated_kv_scales(backend.cache.quantizer, k, v, slot_mapping)
        if self._scaled is None or self._scaled[0] is not backend:
            self._scaled = (backend, backend.with_kv_scales(self.kv_scales))
        return self._scaled[1]

    def reset_kv_scales(self) -> None:
        """Forget the calibrated scales: a new KV quantizer calibrates afresh."""
        self.kv_scales, self._scaled = None, None


class CausalLM(nn.Module):
    """A decoder-only language model on the paged interface.

    Subclasses build their layers in `__init__(config)`, set `layer_specs` (one
    `AttentionLayerSpec` per layer), and implement `forward` and `lm_head_weight`.
    Parameter names match the Hugging Face checkpoint names, so loading is a
    name-for-name copy; `finish_loading` may then merge weights for speed.
    """

    tied_keys: tuple[str, ...] = ()  # checkpoint tensors that may be present but are tied to another
    # Whether `forward` honours `plan(batch, output_rows)`: its last layer runs
    # with `plan.for_last_layer()` and selects its residual rows with `plan.select`.
    computes_output_rows_only: bool = False
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # checkpoint tensors we recompute

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.vocab_size: int = int(config["vocab_size"])
        self.max_model_len: int = int(config.value("max_position_embeddings", 2048))
        self.eos_token_id: int | None = config.eos_token_id()
        self.layer_specs: list[AttentionLayerSpec] = []
        self.attention_backend: type[AttentionBackend] | None = None
        self.kv_quantizer: Quantizer | None = None  # set through set_kv_quantizer
        self._backends: dict[tuple[AttentionLayerSpec, int], AttentionBackend] = {}

    # Backends

    def set_attention_backend(self, backend_cls: type[AttentionBackend]) -> None:
        """Use `backend_cls` for every layer; refuses, with reasons, a backend that cannot
        serve a layer, or cannot read the KV cache as `kv_quantizer` stores it."""
        for spec in dict.fromkeys(self.layer_specs):
            reasons = backend_cls.unsupported_reasons(
                backend_request([spec], self.device.type, self.dtype, kv_quantizer=self.kv_quantizer))
            if reasons:
                raise UnsupportedConfigurationError(
                    f"attention backend {backend_cls.name!r} cannot serve this model: {'; '.join(reasons)}; "
                    "choose another attention backend (see `kvforge plugins --explain`)")
        self.attention_backend = backend_cls
        self._backends = {}

    def set_kv_quantizer(self, quantizer: Quantizer | None) -> None:
        """Store keys and values quantized by `quantizer` (a KV-capable Quantizer
        instance; None: in the model dtype; a static-scale one built with scale=None
        is calibrated per layer on its first write). Call before allocating the cache; an
        attention backend already set is checked again against the new storage dtype."""
        if quantizer is not None:
            check_kv_quantizer(quantizer)
        previous, self.kv_quantizer = self.kv_quantizer, quantizer
        for module in self.modules():
            if isinstance(module, PagedAttention):
                module.reset_kv_scales()
        if self.attention_backend is not None:
            try:
                self.set_attention_backend(self.attention_backend)
            except UnsupportedConfigurationError:
                self.kv_quantizer = previous
                raise

    def backend_for(self, spec: AttentionLayerSpec, block_size: int) -> AttentionBackend:
        """The one backend instance serving every layer with this spec at this block size."""
        key = (spec, block_size)
        if key not in self._backends:
            self._backends[key] = self.backend_class()(spec, self.kv_cache_spec(block_size), self.device)
        return self._backends[key]

    def backend_class(self) -> type[AttentionBackend]:
        if self.attention_backend is None:
            raise ConfigError("this model has no attention backend; pass attention_backend to load_model "
                              "or call set_attention_backend")
        return self.attention_backend

    # Cache

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        first = self.layer_specs[0]
        return KVCacheSpec(block_size=block_size, num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                           dtype=self.dtype, num_layers=len(self.layer_specs), quantizer=self.kv_quantizer)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer, in the backend's `kv_cache_shape` and the
        spec's `tensor_dtype` (raw bytes holding data and scales when quantized)."""
        spec = self.kv_cache_spec(block_size)
        shape = self.backend_class().kv_cache_shape(num_blocks, spec)
        if self.device.type == "cpu":  # on 2 MiB pages where the system allows (huge_pages)
            caches = zeros_on_huge_pages([shape] * len(self.layer_specs), spec.tensor_dtype)
            if caches is not None:
                return caches
        return [torch.zeros(shape, dtype=spec.tensor_dtype, device=self.device) for _ in self.layer_specs]

    # One step

    def plan(self, batch: AttentionBatch, output_rows: torch.Tensor | None = None) -> ModelPlan:
        """Plan the step: each distinct backend instance's `plan` runs once. With
        `output_rows` (a model that `computes_output_rows_only`; the rows as
        `output_rows_batch` takes them), `forward` returns those rows' hidden
        states only, and its last layer computes only them past its KV write."""
        plan = ModelPlan(batch)
        for spec in dict.fromkeys(self.layer_specs):
            backend = self.backend_for(spec, batch.block_size)
            plan.backends[spec] = (backend, backend.plan(batch))
        if output_rows is not None:
            if not self.computes_output_rows_only:
                raise ConfigError(f"{type(self).__name__} computes every row: plan it without output_rows")
            rows_batch = output_rows_batch(batch, output_rows)
            spec = self.layer_specs[-1]
            backend = self.backend_for(spec, batch.block_size)
            rows_plan = backend.plan(rows_batch) if rows_batch.num_seqs else None
            plan.last_layer = ModelPlan(batch, {spec: (backend, rows_plan)}, rows=output_rows)
        return plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                plan: ModelPlan) -> torch.Tensor:
        """Hidden states `[T, hidden_size]` of the step's flattened tokens."""
        raise NotImplementedError

    def lm_head_weight(self) -> torch.Tensor | None:
        """The float output-projection weight `[vocab, hidden]` (the embedding when tied);
        None once the head is quantized (`lm_head_layer` then computes the logits)."""
        raise NotImplementedError

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The repeated blocks (decoder layers) by parameter-name prefix: the
        children of the model's outermost `nn.ModuleList`s."""
        found: list[tuple[str, nn.Module]] = []
        for name, module in self.named_modules():
            if isinstance(module, nn.ModuleList) and not any(name.startswith(prefix + ".") for prefix, _ in found):
                found += [(f"{name}.{i}", block) for i, block in enumerate(module)]
        return found

    def finish_block(self, block: nn.Module) -> None:
        """Called for each block of `blocks()` once its weights are in, before its
        linear layers are packed or quantized: the place to merge weights loaded
        under their checkpoint names into faster layouts. A block already finished
        is left as it is."""

    def finish_loading(self) -> None:
        """Called once the checkpoint's weights are in: `finish_block` on every block."""
        for _, block in self.blocks():
            self.finish_block(block)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[N, vocab_size]` for the rows of `hidden` the caller wants."""
        # A faster copy of the head set at load time: oneDNN-packed (`pack_linears`) or int8 (`quantize_linears`).
        head = getattr(self, "lm_head_layer", None)
        if head is not None:
            return head(hidden).float()
        return F.linear(hidden, self.lm_head_weight()).float()

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds: parameters, buffers, and tensors kept as
        plain module attributes (oneDNN-packed weights); bytes two tensors share count
        once (a tied head; views of one mapping, as `huge_pages` makes)."""
        seen: set[int] = set()
        spans: list[tuple[int, int]] = []
        total = 0
        for module in self.modules():
            held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
            for tensor in held:
                if not isinstance(tensor, torch.Tensor):
                    continue
                size = tensor.numel() * tensor.element_size()
                if not tensor.is_mkldnn:
                    spans.append((tensor.data_ptr(), tensor.data_ptr() + size))
                elif id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += size
        end = 0
        for start, stop in sorted(spans):  # the union of the byte ranges
            total += max(0, stop - max(start, end))
            end = max(end, stop)
        return total

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Map a checkpoint tensor name to this model's parameter name."""
        return name

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device
