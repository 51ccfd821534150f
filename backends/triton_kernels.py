"""Triton kernels of the `triton` attention backend, over the NHD paged cache
`[num_blocks, 2, block_size, num_kv_heads, head_size]`.

* `paged_attention_kernel`: one program per (query tile, KV head, KV split). A
  query tile is up to `BLOCK_Q` consecutive new tokens of one sequence times the
  `QPK` query heads that share the KV head (GQA packing: each key and value tile
  is loaded once for all of them). The kernel reads the block table itself, so
  physical blocks may sit anywhere; online softmax in float32, base 2.
* `reduce_splits_kernel`: merges the partial results of the KV splits of long
  decodes (each split saw one slice of the keys) into the output.
* `write_kv_kernel`: one program per new token, storing its keys and values at
  the slot its slot-mapping entry names (-1: skipped).

A quantized cache (`KV_FORMAT` not `FLOAT_KV`) is read in place: `cache_ptr` is
its data as bytes (NHD, block stride `layer_block_bytes`), `scale_ptr` its
float32 (token, KV head) scales. Each key and value tile is converted from its
storage format to float in registers and scaled there; no dequantized copy of
the cache is ever made.

Importing this module imports triton, so the backend imports it only when it is
built. Every load is masked and every index clamped: under `TRITON_INTERPRET=1`
an out-of-bounds access crashes the process instead of raising.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # jit code may read only constexpr globals

# Storage formats of the KV cache (the KV_FORMAT constexpr).
FLOAT_KV = tl.constexpr(0)  # the compute dtype itself, no scales
INT8_KV = tl.constexpr(1)
FP8_E4M3_KV = tl.constexpr(2)  # torch.float8_e4m3fn
FP8_E5M2_KV = tl.constexpr(3)  # torch.float8_e5m2
KV_FORMAT_OF_STORAGE = {torch.int8: INT8_KV.value, torch.float8_e4m3fn: FP8_E4M3_KV.value,
                        torch.float8_e5m2: FP8_E5M2_KV.value}


@triton.jit
def stored_bytes_to_float(raw, KV_FORMAT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """The float32 values of the 8-bit codes `raw` (uint8), before scaling.

    With NATIVE_FP8 (set on compute capability 8.9 and newer) fp8 codes are
    bitcast to Triton's fp8 types and converted by the hardware. Otherwise fp8
    is decoded with bit operations rather than loaded as an fp8 type: Triton
    compiles e4m3 (`fp8e4nv`) loads only for compute capability 8.9 and newer, and
    this one path runs the same on every GPU and in the interpreter. e5m2 is the
    top byte of an IEEE half; e4m3 (bias 7) placed in a half's bits is the value
    times 2^-8 (bias 15), subnormals included. e5m2's infinity and NaN codes stay
    so; e4m3's NaN codes decode to +-480 (absmax quantizers write none of them).
    """
    if KV_FORMAT == INT8_KV:
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    if NATIVE_FP8:  # compute capability 8.9+: the hardware's fp8 conversions, fewer instructions
        if KV_FORMAT == FP8_E5M2_KV:
            return raw.to(tl.float8e5, bitcast=True).to(tl.float32)
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    wide = raw.to(tl.uint16)
    if KV_FORMAT == FP8_E5M2_KV:
        return (wide << 8).to(tl.float16, bitcast=True).to(tl.float32)
    half = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def paged_attention_kernel(
    q_ptr, cache_ptr, scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_table_ptr, context_lens_ptr, query_start_ptr, tile_seq_ptr, tile_start_ptr, alibi_ptr,
    scale, soft_cap, window, split_len, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_sb, stride_skv, stride_ss, stride_sh, stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, QPK: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, KV_FORMAT: tl.constexpr, NATIVE_FP8: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    # The tile grid is an upper bound: a surplus tile (seq -1) gets no rows and no keys.
    real = seq >= 0
    seq = tl.maximum(seq, 0)
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.where(real, tl.load(query_start_ptr + seq + 1) - q_begin, 0)
    context = tl.load(context_lens_ptr + seq)  # the sequence ends at context + q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_PAD
    rows = tl.arange(0, BLOCK_M)
    local = q_first + rows // QPK_PAD  # token index within the sequence's new tokens
    group = rows % QPK_PAD
    row_ok = (local < q_len) & (group < QPK)
    token = tl.where(row_ok, q_begin + local, 0).to(tl.int64)
    head = tl.where(row_ok, kv_head * QPK + group, 0).to(tl.int64)
    query_pos = context + local
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

    # Keys this tile may see: causal up to its last token, the window back from its first.
    hi = tl.where(real, context + tl.minimum(q_first + BLOCK_Q, q_len), 0)  # one past the last query position
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + q_first - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * split_len)
        hi = tl.minimum(hi, (split + 1) * split_len)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    kv_offset = kv_head.to(tl.int64) * stride_ch
    scale_offset = kv_head.to(tl.int64) * stride_sh
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < hi
        logical = tl.where(key_ok, key_pos // PAGE, 0)
        physical = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + logical, mask=key_ok, other=0)
        slot = physical.to(tl.int64) * stride_cb + (key_pos % PAGE).to(tl.int64) * stride_cs + kv_offset
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0)
        v = tl.load(cache_ptr + stride_ckv + slot[:, None] + dims[None, :], mask=kv_mask, other=0)
        if KV_FORMAT != FLOAT_KV:
            # Keys stay unscaled through the dot (every code is exact in 16-bit floats) and
            # their per-token scale multiplies the scores; values are scaled before theirs.
            scale_slot = physical.to(tl.int64) * stride_sb + (key_pos % PAGE).to(tl.int64) * stride_ss + scale_offset
            k_scale = tl.load(scale_ptr + scale_slot, mask=key_ok, other=0.0)
            v_scale = tl.load(scale_ptr + stride_skv + scale_slot, mask=key_ok, other=0.0)
            k = stored_bytes_to_float(k, KV_FORMAT, NATIVE_FP8).to(q_ptr.dtype.element_ty)
            v = (stored_bytes_to_float(v, KV_FORMAT, NATIVE_FP8) * v_scale[:, None]).to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KV_FORMAT != FLOAT_KV:
            s = s * k_scale[None, :]
        s = s * scale
        if USE_SOFT_CAP:  # cap * tanh(s / cap), tanh written with exp for portability
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        if USE_ALIBI:
            s += slope[:, None] * (key_pos[None, :] - query_pos[:, None]).to(tl.float32)
        s = s * LOG2E
        allowed = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        # Partials [splits, tokens, heads, HEAD_PAD] and (max, sum) [splits, tokens, heads, 2], float32.
        row = (split * num_tokens + token) * num_heads + head
        tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=row_ok)
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def reduce_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_splits, num_tokens, num_heads, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    row = (tl.where(split_ok, splits, 0) * num_tokens + token) * num_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)  # splits that saw no key have m = -inf: weight 0
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_PAD + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    # The skip test is broadcast to a tensor first: the interpreter rejects scalar & tensor masks.
    keep = (heads[:, None] * 0 + dims[None, :] * 0 + slot) >= 0
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE) & keep
    slot = tl.maximum(slot, 0)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    where = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(cache_ptr + where, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_ckv + where, v.to(cache_ptr.dtype.element_ty), mask=mask)
