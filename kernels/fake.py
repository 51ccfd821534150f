"""Fake (meta) implementations of the `kvforge_cpp` ops, for FakeTensor tracing and
torch.compile. The attention ops only mutate an argument and return nothing, so
their fake implementations only have to exist; `int8_weight_linear`,
`int8_dynamic_linear`, `bf16_linear` and `f32_linear` return a new `[rows, out]` tensor (of the input's
dtype, or float32 for `bf16_linear(..., float_out=True)`). Imported by `build.load` once the
library is in."""

from __future__ import annotations

import torch


@torch.library.register_fake("kvforge_cpp::paged_attention")
def _paged_attention_fake(query, kv_cache, query_start_loc, seq_lens, context_lens, block_table,
                          scale, sliding_window, logit_soft_cap, alibi_slopes, out, kv_scales=None,
                          batch_invariant=False) -> None:
    return None


@torch.library.register_fake("kvforge_cpp::write_kv")
def _write_kv_fake(key, value, kv_cache, slot_mapping) -> None:
    return None


@torch.library.register_fake("kvforge_cpp::write_quantized_kv")
def _write_quantized_kv_fake(key, value, kv_data, kv_scales, slot_mapping) -> None:
    return None


@torch.library.register_fake("kvforge_cpp::int8_weight_linear")
def _int8_weight_linear_fake(x, weight, scale, bias=None):
    return x.new_empty((x.shape[0], scale.numel()))  # same dtype and device as x; weight may be packed


@torch.library.register_fake("kvforge_cpp::int8_dynamic_linear")
def _int8_dynamic_linear_fake(x, weight, scale, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kvforge_cpp::bf16_linear")
def _bf16_linear_fake(x, packed, out_features, bias=None, epilogue="none", other=None, float_out=False):
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32 if float_out else x.dtype)


@torch.library.register_fake("kvforge_cpp::f32_linear")
def _f32_linear_fake(x, packed, out_features, bias=None, epilogue="none", other=None):
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("kvforge_cpp::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kvforge_cpp::rotary")
def _rotary_fake(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kvforge_cpp::add_lora")
def _add_lora_fake(y, x, a, b, seg_starts, seg_slots) -> None:
    return None


@torch.library.register_fake("kvforge_cpp::inverse_cdf")
def _inverse_cdf_fake(probs, u):
    return probs.new_empty((probs.shape[0],), dtype=torch.int64)
