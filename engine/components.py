"""Build an engine's parts from an `EngineConfig`, every implementation chosen
through the registry (`Registry.select`), never imported by name."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    QUANTIZER,
    SCHEDULER_POLICY,
    SPECULATIVE_PROPOSER,
    STRUCTURED_OUTPUT,
    AttentionLayerSpec,
    EngineConfig,
    ProposerTarget,
    Quantizer,
    Registry,
    SelectionError,
    SelectionRequest,
    SpeculativeProposer,
    UnsupportedConfigurationError,
    cdiv,
    dtype_name,
)
from kvforge.core.config import FLOAT_DTYPES, FLOAT_KV_DTYPES

log = logging.getLogger(__name__)


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedConfigurationError("device 'cuda' was asked for but CUDA is not available; "
                                            "set device = 'cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return FLOAT_DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def model_layers(name_or_path: str) -> list[AttentionLayerSpec]:
    """Every layer's attention spec (heads, head size, sliding window, soft-cap,
    ALiBi), read without loading weights; empty when it cannot be read (then
    `load_model` raises the precise error)."""
    from kvforge.models.loader import attention_specs

    try:
        return attention_specs(name_or_path)
    except Exception:  # noqa: BLE001 - any failure here resurfaces, explained, in load_model
        return []


def resolve_kv_quantizer(registry: Registry, config: EngineConfig) -> Quantizer | None:
    """The quantizer `cache.kv_cache_dtype` names, as an instance; None for a float
    KV cache (`auto` or a float dtype). Any registered KV-capable quantizer works by
    name, third-party ones included; an unknown name gets the registry's list of
    valid ones, and a quantizer of another granularity is refused with the reason.
    A static-scale one gets `cache.kv_scales`: its scale, or None ("calibrate"),
    which each layer fixes on its first write."""
    name = config.cache.kv_cache_dtype
    if name in FLOAT_KV_DTYPES:
        return None
    from kvforge.models.base import check_kv_quantizer

    try:
        cls = registry.select(QUANTIZER, name).cls
    except SelectionError as exc:
        floats = ", ".join(d for d in FLOAT_KV_DTYPES if d != "auto")
        raise SelectionError(f"cache.kv_cache_dtype = {name!r}: {exc}; or a float KV dtype: {floats}") from exc
    check_kv_quantizer(cls, sorted(r.name for r in registry.implementations(QUANTIZER) if r.cls.kv_capable()))
    if cls.static_scale:
        scales = config.cache.kv_scales
        return cls(None if scales == "calibrate" else float(scales))
    return cls()


def use_kv_quantizer(model, quantizer: Quantizer) -> None:
    """Give a model handed to the engine ready-made the configured KV quantizer."""
    if not hasattr(model, "set_kv_quantizer"):
        raise UnsupportedConfigurationError(
            f"cache.kv_cache_dtype = {quantizer.name!r} asks for a quantized KV cache, but the given model "
            f"({type(model).__name__}) has no set_kv_quantizer (a kvforge CausalLM has); set cache.kv_cache_dtype "
            "= 'auto' or pass a CausalLM")
    model.set_kv_quantizer(quantizer)


def select_backend(registry: Registry, config: EngineConfig, layers: list[AttentionLayerSpec], device: torch.device,
                   dtype: torch.dtype, kv_quantizer: Quantizer | None = None) -> type:
    """The attention backend class for the model's `layers`, judged also on whether it
    reads the KV cache as `kv_quantizer` stores it."""
    from kvforge.models.base import backend_request

    request = backend_request(layers, device.type, dtype, block_size=config.cache.block_size,
                              kv_quantizer=kv_quantizer)
    request = dataclasses.replace(request, kv_cache_dtype=config.cache.kv_cache_dtype,
                                  batch_invariant=config.batch_invariant)
    # prepare=True: the C++ backend builds its kernels here, so a failed build under
    # `auto` moves on to the next backend instead of failing the first layer.
    try:
        return registry.select(ATTENTION_BACKEND, config.attention.backend, request, prepare=True).cls
    except SelectionError as exc:
        if not config.batch_invariant:
            raise
        declaring = [r.name for r in registry.implementations(ATTENTION_BACKEND) if r.cls.batch_invariant]
        raise SelectionError(f"batch_invariant = true: {exc}; choose one of: {', '.join(declaring) or 'none installed'} "
                             "(backends that declare batch_invariant), or turn batch_invariant off") from exc


BATCH_VARIANT_LINEARS = {
    "torch": "F.linear sums a single row another way than several (a matrix-vector path)",
    "onednn": "oneDNN splits a deep input over threads for some row counts",
}
"""Linear kernels whose per-row sums change with the number of rows, and how."""


def linear_kernel(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> str:
    """The `linear_kernel` to load the model with: the configured one, except that with
    `batch_invariant` it must be kvforge's C++ kernels (each output sums its inputs in
    one order whatever the row count), which `auto` then means; others are refused."""
    if not config.batch_invariant:
        return config.linear_kernel
    if config.linear_kernel in BATCH_VARIANT_LINEARS:
        raise UnsupportedConfigurationError(
            f"batch_invariant = true needs linear_kernel 'cpp' or 'auto', not {config.linear_kernel!r}: "
            f"{BATCH_VARIANT_LINEARS[config.linear_kernel]}")
    from kvforge.models.cpp_linear import cpp_linear_unavailable

    why_not = cpp_linear_unavailable(dtype, device)
    if why_not is not None:
        raise UnsupportedConfigurationError(
            f"batch_invariant = true runs every linear layer on kvforge's C++ kernels, and {why_not}; "
            "use a float32 or bfloat16 CPU model, or turn batch_invariant off")
    return "cpp"


def check_batch_invariant(config: EngineConfig) -> None:
    """Refuse, naming each setting, what batch-invariant mode does not cover."""
    if not config.batch_invariant:
        return
    refused = []
    if config.speculative.proposer is not None:
        refused.append(f"speculative.proposer = {config.speculative.proposer!r} (whether a request gets drafts, and "
                       "how its random draws are spent verifying them, depends on the batch)")
    if config.lora.enabled:
        refused.append("lora.enabled (the LoRA kernels, which group a step's rows by adapter, are not verified "
                       "batch-invariant)")
    if config.quantization.weights is not None:
        refused.append(f"quantization.weights = {config.quantization.weights!r} (the int8 linears take another path "
                       "for a prefill's rows than for a decode's)")
    if config.parallel.world_size > 1:
        refused.append(f"tensor/pipeline parallelism over {config.parallel.world_size} ranks (the mode is verified "
                       "on one rank: the ranks' sums and collectives are not)")
    if refused:
        raise UnsupportedConfigurationError(
            "batch_invariant = true does not cover: " + "; ".join(refused) + "; unset these or turn batch_invariant off")


def build_allocator(registry: Registry, config: EngineConfig, num_blocks: int):
    cache = config.cache
    request = SelectionRequest(block_size=cache.block_size, prefix_caching=cache.enable_prefix_caching or None)
    try:
        cls = registry.select(BLOCK_ALLOCATOR, cache.allocator, request).cls
    except SelectionError as exc:
        if not cache.enable_prefix_caching or cache.allocator not in registry.names(BLOCK_ALLOCATOR):
            raise
        raise SelectionError(f"cache.allocator = {cache.allocator!r}: {exc}; set cache.enable_prefix_caching=false "
                             "to use it (prefix caching is on by default)") from exc
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


def build_proposer(registry: Registry, config: EngineConfig, target: ProposerTarget) -> SpeculativeProposer | None:
    """The configured speculative proposer, built with `speculative.options` and set up
    for the target model once; None when `speculative.proposer` is unset."""
    spec = config.speculative
    if spec.proposer is None:
        return None
    proposer = registry.select(SPECULATIVE_PROPOSER, spec.proposer).cls(**spec.options)
    proposer.setup(target)
    return proposer


def num_blocks(config: EngineConfig, spec, device: torch.device, max_model_len: int) -> int:
    """`cache.num_blocks` if set, otherwise sized by `cache_sizing` on `device`,
    capped at what the scheduler could ever fill (every sequence at full context)."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    from .cache_sizing import num_blocks_for

    most = config.scheduler.max_num_seqs * cdiv(max_model_len, config.cache.block_size)
    return num_blocks_for(config.cache, spec, device=device, max_blocks=most)


def check_supported(config: EngineConfig, dtype: torch.dtype) -> None:
    """Refuse, with the reason, settings the reference engine does not implement."""
    check_batch_invariant(config)
    kv_dtype = config.cache.kv_cache_dtype  # a quantizer name is resolved by resolve_kv_quantizer
    if kv_dtype in FLOAT_DTYPES and FLOAT_DTYPES[kv_dtype] != dtype:
        raise UnsupportedConfigurationError(
            f"cache.kv_cache_dtype = {kv_dtype!r} differs from the model dtype {dtype_name(dtype)}; "
            "the reference engine keeps the KV cache in the model dtype; set cache.kv_cache_dtype = 'auto'")


def selected_names(model, allocator, policy, kv_quantizer: Quantizer | None, weight_quantizer: Quantizer | None,
                   proposer: SpeculativeProposer | None) -> dict[str, str]:
    """The name of each implementation an engine runs with, by part; the quantizers and
    the proposer only when configured. A ready-made model without a kvforge attention
    backend (a test double) has no `attention_backend` entry."""
    backend = getattr(model, "attention_backend", None)
    parts = {ATTENTION_BACKEND: backend, BLOCK_ALLOCATOR: allocator, SCHEDULER_POLICY: policy,
             "kv_quantizer": kv_quantizer, "weight_quantizer": weight_quantizer, SPECULATIVE_PROPOSER: proposer}
    return {part: chosen.name for part, chosen in parts.items() if chosen is not None}


def describe_selection(selected: dict[str, str]) -> str:
    """One line naming what `selected_names` found, as vLLM's "Using ... backend" line."""
    return "kvforge engine: " + ", ".join(f"{part.replace('_', ' ')} {name}" for part, name in selected.items())


def build_structured_outputs(registry: Registry, config: EngineConfig, vocabulary):
    """The engine's `StructuredOutputs`: per spec, the backend `structured_outputs.backend`
    names (or, for auto, the registry's first that compiles the spec); `vocabulary`
    builds the model's `Vocabulary` when the first structured request arrives."""
    from .structured_outputs import StructuredOutputs

    settings = config.structured_outputs

    def select(spec):
        request = SelectionRequest(structured_output_spec=spec)
        try:
            return registry.select(STRUCTURED_OUTPUT, settings.backend, request).cls
        except SelectionError as exc:
            able = [r.name for r in registry.implementations(STRUCTURED_OUTPUT) if r.name != settings.backend
                    and r.cls.availability().ok and not r.cls.spec_unsupported_reasons(spec)]
            hint = f"; backends that can: {', '.join(able)}" if able else ""
            raise SelectionError(f"structured_outputs.backend = {settings.backend!r}: {exc}{hint}") from exc

    return StructuredOutputs(select, vocabulary, options=settings.options,
                             compile_timeout_s=settings.compile_timeout_s,
                             max_cached_grammars=settings.max_cached_grammars)


def build_lora_adapters(config: EngineConfig, model, runner):
    """The engine's `LoRAAdapters` when `lora.enabled` (the model's LoRA slots made
    if the model was handed over ready), else None. A runner of several ranks
    (`load_lora`) has every other rank load each adapter rank 0 puts in a slot."""
    if not config.lora.enabled:
        return None
    from kvforge.models.lora_layers import enable_lora

    from .lora_adapters import LoRAAdapters

    if getattr(model, "lora", None) is None:
        enable_lora(model, max_loras=config.lora.max_loras, max_rank=config.lora.max_lora_rank)
    return LoRAAdapters(model, config.lora, on_slot_load=getattr(runner, "load_lora", None))
