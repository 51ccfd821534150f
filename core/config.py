"""The engine configuration: one validated pydantic model, one section per part.

Where values come from, and how they override each other, lives in
`config_sources.py`; checking implementation names against the registry lives in
`check_implementation_names` below.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .api import (
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    QUANTIZER,
    SCHEDULER_POLICY,
    SPECULATIVE_PROPOSER,
    STRUCTURED_OUTPUT,
)

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The float dtypes models and KV caches run in, by the name configs use: the one name -> dtype table."""
FLOAT_KV_DTYPES = ("auto", *FLOAT_DTYPES)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AttentionConfig(Section):
    backend: str = Field(
        "auto", description="attention_backend name, or auto: the available one with the highest priority that "
                            "serves the model (`kvforge plugins --explain` says why not the others)")


class CacheConfig(Section):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; overrides memory_budget")
    memory_budget: float | None = Field(
        None, description="KV cache size: bytes (int or '4GiB') or a fraction (0, 1) of available memory")
    kv_cache_dtype: str = Field(
        "auto", description="auto (the model dtype), the model's float dtype, or the name of a KV-capable quantizer: "
                            "per_token (int8, fp8_e4m3, fp8_e5m2, or a third-party one: one float32 scale per token "
                            "and KV head) or static-scale (fp8_e4m3_per_tensor, fp8_e5m2_per_tensor: one fixed scale "
                            "per layer for keys and one for values, see kv_scales); the attention backend must read it")
    kv_scales: float | Literal["calibrate"] = Field(
        1.0, description="the fixed scale of a static-scale KV quantizer (fp8_e4m3_per_tensor...): a positive number "
                         "for every layer's keys and values (values beyond scale x the format max saturate), or "
                         "'calibrate': each layer's from its first prefill's largest key and value, with 2x headroom")
    enable_prefix_caching: bool = Field(
        True, description="reuse the cached KV blocks of equal prompt prefixes; needs an allocator with prefix caching "
                          "(set it false to use one without)")
    allocator: str = Field("auto", description="block_allocator name, or auto")
    hash_algorithm: str = Field(
        "sha256", description="hashlib algorithm of the prefix-cache block hashes (the allocator lists those it has "
                              "in `kvforge plugins --json`)")

    @field_validator("kv_scales")
    @classmethod
    def _positive_scale(cls, value):
        if value != "calibrate" and not (math.isfinite(value) and value >= torch.finfo(torch.float32).tiny):
            raise ValueError("must be a positive finite number (a float32 normal) or 'calibrate'")
        return value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _parse_size(cls, value):
        if isinstance(value, str):
            match = _SIZE.match(value)
            if not match:
                raise ValueError(f"{value!r} is not a size; write bytes (4294967296), '4GiB', '512MB' or a fraction like 0.5")
            number, unit = float(match.group(1)), (match.group(2) or "b").lower()
            return number * _UNITS[unit]
        return value

    @field_validator("memory_budget")
    @classmethod
    def _positive(cls, value):
        if value is not None and (value <= 0 or (1 <= value and value != int(value))):
            raise ValueError("must be a fraction in (0, 1) of available memory or a whole number of bytes >= 1")
        return value


class SchedulerConfig(Section):
    policy: str = Field("auto", description="scheduler_policy name, or auto (fcfs among the built-in ones)")
    max_num_seqs: int = Field(128, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    num_scheduler_steps: int = Field(
        16, ge=1, le=64, description="most decode passes run per scheduler step (multi-step decoding): while every "
                                     "running request decodes plainly (no drafts, grammar, logit bias, logprobs or "
                                     "min_tokens still to reach; penalties only where the model's C++ decoder stack "
                                     "runs the burst) and none waits, the engine runs up to this many forward passes "
                                     "(fewer once max_burst_s has passed) before it schedules, applies results "
                                     "and reports outputs again, so that work is paid once per burst; outputs "
                                     "then arrive in bursts. 1: every step is scheduled. See docs/engine.md")
    max_burst_s: float = Field(
        0.01, gt=0, description="seconds a multi-step burst may run: it ends after the pass that reaches this time "
                                "since it began, which bounds how late a new request starts and how far apart a "
                                "stream's outputs arrive")


class QuantizationConfig(Section):
    weights: str | None = Field(
        None, description="name of a per_channel int8 quantizer (int8_weight, or a third-party one): every linear layer "
                          "and an untied LM head hold int8 weights quantized at load time; none: float weights")
    activations: Literal["none", "int8"] = Field(
        "none", description="with quantization.weights: none keeps activations float (weight-only, W8A16: kvforge's "
                            "C++ kernel on CPU); int8 quantizes each activation row too (W8A8, CPU only: kvforge's C++ "
                            "op, or torch ops where it cannot build). See docs/quantization.md")


class SpeculativeConfig(Section):
    proposer: str | None = Field(
        None, description="speculative_proposer name (ngram, draft_model, or a third-party one); none: no speculative "
                          "decoding")
    num_tokens: int = Field(4, ge=1, le=32, description="most draft tokens per request and step (k)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the proposer's own options, passed as cls(**options); unknown ones are "
                                          "refused (ngram: min_n, max_n; draft_model: model, num_blocks, ...; see "
                                          "docs/speculative.md)")
    disable_above_batch_size: int | None = Field(
        None, ge=1, description="no drafts while more requests than this run (decode is compute-bound there)")
    draft_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive: per request and step, as many drafts (up to num_tokens, maybe none) as "
                                "maximise expected tokens per second, from the request's measured acceptance and the "
                                "engine's measured step costs; fixed: num_tokens drafts whenever the proposer has them")


class StructuredOutputsConfig(Section):
    backend: str = Field(
        "auto", description="structured_output name (xgrammar, llguidance, outlines, or a third-party one), or auto: "
                            "per request, the available one with the highest priority that compiles its spec "
                            "(`kvforge plugins --explain` says why not the others)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the named backend's own options, passed as cls(vocabulary, **options); "
                                          "unknown ones are refused (see docs/structured_outputs.md)")
    compile_timeout_s: float = Field(
        30.0, gt=0, description="seconds a grammar may take to compile; past it only that request ends, with an "
                                "error naming its spec")
    max_cached_grammars: int = Field(
        256, ge=0, description="specs whose compile outcome (a grammar or its error) is remembered, least recently "
                               "used dropped first; 0: none")


class LoRAConfig(Section):
    enabled: bool = Field(
        False, description="serve LoRA adapters beside the base model; giving any other lora setting turns it on")
    max_loras: int = Field(1, ge=1, description="most distinct adapters in one step; requests of a further adapter "
                                                 "wait until one of those finishes")
    max_lora_rank: int = Field(16, ge=1, le=512, description="largest adapter rank accepted; the slot buffers are "
                                                              "this wide")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept loaded in memory, least recently used dropped first (reloaded from "
                                "their directory when needed again); none: max_loras")

    @model_validator(mode="after")
    def _enabled_when_set(self) -> "LoRAConfig":
        if "enabled" not in self.model_fields_set and self.model_fields_set:
            object.__setattr__(self, "enabled", True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras ({self.max_cpu_loras}) must be at least lora.max_loras "
                             f"({self.max_loras}): every adapter in a step is also one kept loaded")
        return self

    @property
    def cpu_capacity(self) -> int:
        """How many adapters stay loaded in memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class ParallelConfig(Section):
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks that split every layer's heads and MLP (Megatron-style); 1: no tensor parallelism")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="ranks that each hold a stage of consecutive layers, run one after another; "
                             "1: no pipeline parallelism")
    executor: str = Field(
        "auto", min_length=1,
        description="how ranks 1.. run, by the name of a `kvforge.executors` entry point: mp (processes on this "
                    "host), ray (Ray actors, on any node of a Ray cluster; kvforge[ray]), "
                    "torchrun or external (processes torchrun started, on one or more hosts); auto: torchrun under "
                    "torchrun, else mp. The engine's own process is always rank 0")
    collective_timeout_s: float = Field(
        120.0, gt=0, description="seconds a collective may wait for a rank before the engine fails, naming it")
    vocab_parallel: bool = Field(
        True, description="under tensor parallelism, split the token embedding and the LM head by vocabulary rows "
                          "over the tensor-parallel ranks (Megatron style); false: every rank holds them whole")

    @property
    def world_size(self) -> int:
        """How many ranks (processes) the engine runs: 1 for a single-process engine."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class PluginsConfig(Section):
    allow: list[str] | None = Field(None, description="entry-point names to load; none means all")
    deny: list[str] = Field(default_factory=list, description="entry-point names never to load")
    strict: bool = Field(False, description="a plugin that fails to load is an error, not a warning")


class EngineConfig(Section):
    """Every setting of a kvforge engine."""

    model: str = Field(
        "kvforge-tiny", description="a local Hugging Face directory (safetensors) or a built-in model name "
                                    "(a misspelt one is refused with the list)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model and KV cache live; auto: CUDA when present")
    dtype: Literal[FLOAT_KV_DTYPES] = Field(
        "auto", description="the model's compute dtype; auto: the checkpoint's (float32 when it names none)")
    seed: int = Field(0, description="engine-wide random seed")
    linear_kernel: Literal["auto", "torch", "onednn", "cpp"] = Field(
        "auto", description="kernel of the model's linear layers: onednn (CPU, weights packed once), cpp (kvforge's "
                        "C++ kernels, bfloat16 and float32 CPU models), torch, or auto (cpp for bfloat16 on a CPU "
                        "with AVX-512 BF16 or AVX2 and for float32 on a CPU with AVX-512 or AVX2, else onednn for "
                        "weights of at least 512 x 512 where available); with quantization.weights, of the layers "
                        "left in float")
    keep_freed_memory: bool = Field(
        True, description="CPU, glibc: keep freed heap memory for reuse (no page faults on each step's activations); "
                          "process-wide")
    batch_invariant: bool = Field(
        False, description="a request's greedy tokens, seeded samples and logprobs are bitwise the same alone or in "
                           "any batch, under any prefill chunking and with or without prefix-cache hits: every "
                           "reduction runs in one fixed order per row (kvforge's C++ linears, RMSNorm and rotary; an "
                           "attention backend that declares batch_invariant, cpp_batch_invariant under auto). CPU, "
                           "float32 and bfloat16; refused with speculative decoding, LoRA, int8 weights and tensor "
                           "or pipeline parallelism. Decodes cost the same; prompts' attention runs slower "
                           "(docs/determinism.md)")
    warmup: bool = Field(
        True, description="run one throwaway step when the engine starts: on a GPU of max_num_batched_tokens "
                          "tokens, so the first requests do not pay for first-touch memory and new kernel shapes "
                          "(vLLM does the same); on a CPU one short sequence, which shows the model runs without "
                          "spending the start-up on a full step's arithmetic")
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)


IMPLEMENTATION_FIELDS: dict[str, str] = {
    "attention.backend": ATTENTION_BACKEND,
    "cache.allocator": BLOCK_ALLOCATOR,
    "scheduler.policy": SCHEDULER_POLICY,
    "quantization.weights": QUANTIZER,
    "speculative.proposer": SPECULATIVE_PROPOSER,
    "structured_outputs.backend": STRUCTURED_OUTPUT,
}
"""Config fields that name an implementation, and the kind each names."""


def implementation_names(config: EngineConfig) -> dict[str, tuple[str, str]]:
    """`{field: (kind, name)}` for every field that names an implementation (none-valued left out)."""
    named = {}
    for path, kind in IMPLEMENTATION_FIELDS.items():
        section, key = path.split(".")
        value = getattr(getattr(config, section), key)
        if value is not None:
            named[path] = (kind, value)
    if config.cache.kv_cache_dtype not in FLOAT_KV_DTYPES:
        named["cache.kv_cache_dtype"] = (QUANTIZER, config.cache.kv_cache_dtype)
    return named
