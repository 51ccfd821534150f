"""kvforge.core: the contract every implementation and every host agrees on.

Read in this order: `api` (versions and kinds), `implementation` (what all
implementations share), the paged KV cache's layout (`kv_cache`), the six
interfaces (`attention`, `block_allocator`, `scheduler_policy`, `quantizer`,
`speculative`, `structured_output`), `hookspecs` (how a plugin registers),
`registry` (discovery and selection), `config` and `config_sources`.
"""

from .api import (
    API_VERSION,
    ATTENTION_BACKEND,
    BLOCK_ALLOCATOR,
    ENTRY_POINT_GROUP,
    KINDS,
    QUANTIZER,
    SCHEDULER_POLICY,
    SPECULATIVE_PROPOSER,
    STRUCTURED_OUTPUT,
)
from .attention import (
    ALIBI,
    LOGIT_SOFT_CAP,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    AttentionLayerSpec,
    attention_request,
    kv_cache_request,
)
from .block_allocator import AllocatorUsage, BlockAllocator, BlockHash
from .config import FLOAT_DTYPES, EngineConfig, implementation_names
from .config_sources import LoadedConfig, check_implementation_names, load_config
from .dtypes import dtype_name
from .errors import (
    ApiVersionError,
    BlockStateError,
    ConfigError,
    DistributedError,
    DuplicateImplementationError,
    KvforgeError,
    OutOfBlocksError,
    PluginError,
    QuantizationError,
    RequestError,
    SelectionError,
    StructuredOutputError,
    UnsupportedConfigurationError,
)
from .hookspecs import hookimpl, hookspec
from .implementation import Availability, Implementation, SelectionRequest
from .kv_cache import (
    NHD,
    SCALE_DTYPE,
    KVCacheSpec,
    PagedCSR,
    cdiv,
    dequantize_kv_blocks,
    paged_csr,
    quantized_kv_views,
    write_kv_by_slot,
    write_quantized_kv_by_slot,
)
from .quantizer import (
    GRANULARITIES,
    PER_CHANNEL,
    PER_TENSOR,
    PER_TOKEN,
    QuantizedTensor,
    Quantizer,
    StaticScaleQuantizer,
)
from .registry import AUTO, Candidate, LoadError, PluginFilter, Registration, Registry, build_registry
from .scheduler_policy import RequestView, SchedulerPolicy
from .speculative import DraftProposal, ProposalRequest, ProposerTarget, SpeculativeProposer
from .structured_output import (
    SPEC_KINDS,
    Grammar,
    StructuredOutputBackend,
    StructuredOutputSpec,
    Vocabulary,
    apply_token_bitmask,
)

INTERFACES: dict[str, type[Implementation]] = {
    ATTENTION_BACKEND: AttentionBackend,
    BLOCK_ALLOCATOR: BlockAllocator,
    SCHEDULER_POLICY: SchedulerPolicy,
    QUANTIZER: Quantizer,
    SPECULATIVE_PROPOSER: SpeculativeProposer,
    STRUCTURED_OUTPUT: StructuredOutputBackend,
}

__all__ = [name for name in dir() if not name.startswith("_")]
