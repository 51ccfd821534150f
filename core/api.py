"""The version of the contract and the canonical names of the six kinds."""

API_VERSION: tuple[int, int] = (1, 4)
"""(major, minor). A plugin written for another major is refused; one that needs a
newer minor than this host offers is refused too.

1.1: quantized KV caches (`KVCacheSpec.quantizer`, `AttentionBackend.quantized_kv_dtypes`,
`SelectionRequest.kv_storage_dtype`).
1.2: static-scale quantizers for the KV cache (`StaticScaleQuantizer`, `Quantizer.static_scale`
and `kv_capable`, `KVCacheSpec.kv_scales`, `AttentionBackend.kv_scale_granularities` and
`with_kv_scales`, `SelectionRequest.kv_scale_granularity`). Everything written for 1.1
works unchanged: the new attributes have defaults that mean what 1.1 meant.
1.3: the `structured_output` kind (`StructuredOutputBackend`, `Grammar`, `StructuredOutputSpec`,
`Vocabulary`, `SelectionRequest.structured_output_spec`) and `Implementation.prepare` (one-time
set-up such as compiling kernels; under `auto` a failure moves on to the next implementation);
additions defaulted so 1.2 plugins keep working.
1.4: batch invariance (`AttentionBackend.batch_invariant`, guarantee 8, and
`SelectionRequest.batch_invariant`), `AttentionBackend.kv_views` (how a cache in a
backend's own layout is read) and `SpeculativeProposer.cheap`; all defaulted, so 1.3
plugins keep working."""

ENTRY_POINT_GROUP = "kvforge.plugins"

ATTENTION_BACKEND = "attention_backend"
BLOCK_ALLOCATOR = "block_allocator"
SCHEDULER_POLICY = "scheduler_policy"
QUANTIZER = "quantizer"
SPECULATIVE_PROPOSER = "speculative_proposer"
STRUCTURED_OUTPUT = "structured_output"

KINDS: tuple[str, ...] = (
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    SCHEDULER_POLICY,
    QUANTIZER,
    SPECULATIVE_PROPOSER,
    STRUCTURED_OUTPUT,
)
