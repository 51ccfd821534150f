"""The `triton` attention backend, run under Triton's interpreter on the CPU.

`TRITON_INTERPRET=1` must be set before triton is first imported, and the test
suite shares one process, so the kernel checks run once in a subprocess (this
file run as a script) and each test asserts one scenario's outcome. Shapes are
tiny: the interpreter takes up to a second per launch. Quantized-KV scenarios
(`quantized_*`) read int8 and fp8 caches through the same kernel.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    QUANTIZER,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    PER_TOKEN,
    Quantizer,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
    cdiv,
    dequantize_kv_blocks,
    dtype_name,
    quantized_kv_views,
    write_quantized_kv_by_slot,
)

# Scenarios run in the subprocess; each returns an error message or None


def make_step(lengths, layer, block_size, dtype, seed, values_seed=None):
    """A random step: (batch, query, new keys/values, cache holding garbage and the context,
    unused blocks NaN). Physical blocks are a random permutation; `values_seed` draws other
    values for the same batch (another layer)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(c + q, block_size) for c, q in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = physical[used:used + n].to(torch.int32)
        used += n
    kvh, d = layer.num_kv_heads, layer.head_size
    if values_seed is not None:
        gen.manual_seed(values_seed)
    cache = torch.randn(num_blocks, 2, block_size, kvh, d, generator=gen).to(dtype)
    cache[physical[used:]] = float("nan")

    def slots(b, first, last):
        pos = torch.arange(first, last)
        return table[b, pos // block_size].long() * block_size + pos % block_size

    for b, (c, _) in enumerate(lengths):  # the context, written independently of the backend
        s = slots(b, 0, c)
        cache[s // block_size, :, s % block_size] = torch.randn(c, 2, kvh, d, generator=gen).to(dtype)
    queries = [q for _, q in lengths]
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32)
    batch = AttentionBatch(starts, torch.tensor([c + q for c, q in lengths], dtype=torch.int32),
                           torch.tensor([c for c, _ in lengths], dtype=torch.int32), table,
                           torch.cat([slots(b, c, c + q) for b, (c, q) in enumerate(lengths)]), block_size,
                           max(queries), max(c + q for c, q in lengths))
    tokens = sum(queries)
    query = torch.randn(tokens, layer.num_heads, d, generator=gen).to(dtype)
    new_k, new_v = (torch.randn(tokens, kvh, d, generator=gen).to(dtype) for _ in range(2))
    return batch, query, new_k, new_v, cache


def reference(query, cache, batch, layer):
    """Float64 attention as kvforge.core.attention defines it, one sequence at a time."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    bs = batch.block_size
    for b in range(batch.num_seqs):
        start, end = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        seq_len, context = int(batch.seq_lens[b]), int(batch.context_lens[b])
        pos = torch.arange(seq_len)
        rows = cache[batch.block_table[b, pos // bs].long(), :, pos % bs].double()  # [seq, 2, kvh, d]
        group = layer.queries_per_kv
        keys, values = (rows[:, i].repeat_interleave(group, 1).transpose(0, 1) for i in (0, 1))
        q = query[start:end].double().transpose(0, 1)
        scores = q @ keys.transpose(1, 2) * layer.softmax_scale
        if layer.logit_soft_cap:
            scores = layer.logit_soft_cap * torch.tanh(scores / layer.logit_soft_cap)
        dist = pos[None, :] - (context + torch.arange(end - start))[:, None]
        if layer.alibi_slopes:
            scores = scores + torch.tensor(layer.alibi_slopes, dtype=torch.float64)[:, None, None] * dist
        allowed = dist <= 0
        if layer.sliding_window:
            allowed &= dist > -layer.sliding_window
        out[start:end] = (scores.masked_fill(~allowed, -math.inf).softmax(-1) @ values).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def attend(lengths, layer, block_size, dtype, seed, force_split=False, expect_split=False, packed=False):
    from kvforge.backends.triton_attention import TritonAttentionBackend

    batch, query, new_k, new_v, cache = make_step(lengths, layer, block_size, dtype, seed)
    if packed:  # query, keys and values as views of one fused projection output, as models produce them
        qkv = torch.cat([query, new_k, new_v], dim=1)
        heads, kvh = layer.num_heads, layer.num_kv_heads
        query, new_k, new_v = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]
    backend = TritonAttentionBackend(layer, KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, dtype), "cpu")
    if force_split:
        backend.split_min_len, backend.num_sms = 8, 64
    backend.write_kv(new_k, new_v, cache, batch.slot_mapping)
    plan = backend.plan(batch)
    if expect_split and plan.num_splits < 2:
        return f"expected a split-KV plan, got {plan.num_splits} split(s)"
    out = torch.full_like(query, float("nan"))
    if backend.forward(query, cache, plan, out=out) is not out:
        return "forward(out=...) did not return `out`"
    if not torch.isfinite(out).all():
        return f"{int((~torch.isfinite(out)).sum())} output elements not written or not finite"
    expected = reference(query, cache, batch, layer)
    error = float((out.double() - expected).norm() / expected.norm())
    return None if error <= TOLERANCE[dtype] else f"relative error {error:.3g} > {TOLERANCE[dtype]:g}"


def scenario_write_kv():
    from kvforge.backends.triton_attention import TritonAttentionBackend

    layer = AttentionLayerSpec(4, 2, 64)
    for dtype in (torch.float32, torch.bfloat16):
        backend = TritonAttentionBackend(layer, KVCacheSpec(4, 2, 64, dtype), "cpu")
        gen = torch.Generator().manual_seed(1)
        cache = torch.randn(5, 2, 4, 2, 64, generator=gen).to(dtype)
        slots = torch.tensor([7, -1, 0, 19, 12, -1, 3])
        keys, values = (torch.randn(7, 2, 64, generator=gen).to(dtype) for _ in range(2))
        expected = cache.clone()
        keep = slots >= 0
        expected[slots[keep] // 4, 0, slots[keep] % 4] = keys[keep]
        expected[slots[keep] // 4, 1, slots[keep] % 4] = values[keep]
        backend.write_kv(keys, values, cache, slots)
        if not torch.equal(cache, expected):
            return f"{dtype}: {int((cache != expected).sum())} cache elements differ from the slot mapping's"
    return None


def scenario_decode_gqa():
    return attend([(9, 1), (17, 1), (3, 1)], AttentionLayerSpec(8, 2, 64), 16, torch.float32, 2)


def scenario_mixed():
    return attend([(0, 6), (13, 1), (5, 4)], AttentionLayerSpec(16, 2, 80), 8, torch.float16, 3)


def scenario_chunked_many_tiles():  # query_len beyond one query tile, one-token blocks
    return attend([(7, 21), (2, 1)], AttentionLayerSpec(2, 2, 64), 1, torch.bfloat16, 4)


def scenario_strided_views():
    return attend([(6, 2), (3, 1)], AttentionLayerSpec(4, 2, 64), 8, torch.float16, 10, packed=True)


def scenario_split_kv():
    return attend([(70, 1), (41, 1)], AttentionLayerSpec(8, 2, 64), 16, torch.float32, 5, True, True)


def scenario_features():
    layer = AttentionLayerSpec(4, 2, 64, sliding_window=6, logit_soft_cap=3.0, alibi_slopes=(0.5, 0.25, 0.125, 0.0625))
    return attend([(40, 3), (70, 1)], layer, 8, torch.float32, 6, True, True)  # most splits outside the window


def scenario_plan_reused_by_layers():
    from kvforge.backends.triton_attention import TritonAttentionBackend

    layer = AttentionLayerSpec(4, 2, 64)
    spec = KVCacheSpec(8, 2, 64, torch.float32)
    backend = TritonAttentionBackend(layer, spec, "cpu")
    batch, *_ = make_step([(5, 3), (12, 1)], layer, 8, torch.float32, 7)
    plan = backend.plan(batch)
    before = (plan.tile_seq.clone(), plan.tile_start.clone())
    for seed in (8, 9):
        _, query, new_k, new_v, cache = make_step([(5, 3), (12, 1)], layer, 8, torch.float32, 7, seed)
        backend.write_kv(new_k, new_v, cache, batch.slot_mapping)
        out = backend.forward(query, cache, plan)
        error = float((out.double() - reference(query, cache, batch, layer)).norm())
        if not error < 1e-3:
            return f"layer with seed {seed}: error {error:.3g} when reusing the plan"
    if not (torch.equal(before[0], plan.tile_seq) and torch.equal(before[1], plan.tile_start)):
        return "forward modified the plan"
    return None


def scenario_interpreter_class_settings():
    from kvforge.backends.triton_attention import TritonAttentionBackend as cls

    if cls.conformance_grid != "reduced" or cls.priority >= 0 or not cls.availability().ok:
        return f"grid {cls.conformance_grid!r}, priority {cls.priority}, availability {cls.availability()}"
    return None


# Quantized KV: the kernel reads the stored bytes and scales (kvforge.core.quantized_kv_views) in place.

KV_QUANTIZERS = ("int8", "fp8_e4m3", "fp8_e5m2")


def quantized_spec(layer, block_size, dtype, quantizer_name) -> KVCacheSpec:
    quantizer = build_registry().select(QUANTIZER, quantizer_name).cls()
    return KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, dtype, quantizer=quantizer)


def make_quantized_step(lengths, layer, block_size, dtype, quantizer_name, seed):
    """`make_step` over a quantized cache: random bytes everywhere, NaN scales in every slot
    no token was written to (reading one would poison the output), the context quantized by
    the core's write. Keys and values span magnitudes 1e-2..1e2 per (token, head), so
    ignoring or misplacing a scale changes the result far beyond the tolerance."""
    batch, query, new_k, new_v, float_cache = make_step(lengths, layer, block_size, dtype, seed)
    spec = quantized_spec(layer, block_size, dtype, quantizer_name)
    gen = torch.Generator().manual_seed(seed + 1000)
    cache = torch.randint(0, 256, (float_cache.shape[0], spec.layer_block_bytes()), dtype=torch.uint8, generator=gen)
    quantized_kv_views(cache, spec)[1].fill_(float("nan"))

    def spread(x):
        return (x.float() * 10.0 ** (4 * torch.rand(*x.shape[:2], 1, generator=gen) - 2)).to(dtype)

    pos = [torch.arange(c) for c, _ in lengths]
    slots = torch.cat([batch.block_table[b, p // block_size].long() * block_size + p % block_size
                       for b, p in enumerate(pos)])
    context = float_cache[slots // block_size, :, slots % block_size]  # [tokens, 2, kvh, d]
    write_quantized_kv_by_slot(spread(context[:, 0]), spread(context[:, 1]), cache, slots, spec)
    return batch, query, spread(new_k), spread(new_v), cache, spec


def attend_quantized(lengths, layer, block_size, dtype, quantizer_name, seed, force_split=False):
    """The kernel over a quantized cache against the float64 reference over the dequantized
    KV (`dequantize_kv_blocks`); also checks that a kernel ignoring the scales would fail."""
    from kvforge.backends.triton_attention import TritonAttentionBackend

    batch, query, new_k, new_v, cache, spec = make_quantized_step(lengths, layer, block_size, dtype,
                                                                  quantizer_name, seed)
    backend = TritonAttentionBackend(layer, spec, "cpu")
    if force_split:
        backend.split_min_len, backend.num_sms = 8, 64
    backend.write_kv(new_k, new_v, cache, batch.slot_mapping)
    plan = backend.plan(batch)
    if force_split and plan.num_splits < 2:
        return f"expected a split-KV plan, got {plan.num_splits} split(s)"
    out = torch.full_like(query, float("nan"))
    backend.forward(query, cache, plan, out=out)
    if not torch.isfinite(out).all():
        return f"{int((~torch.isfinite(out)).sum())} output elements not written or not finite"
    blocks = torch.arange(cache.shape[0])
    expected = reference(query, dequantize_kv_blocks(cache, spec, blocks, torch.float64), batch, layer)
    error = float((out.double() - expected).norm() / expected.norm())
    if error > TOLERANCE[dtype]:
        return f"relative error {error:.3g} > {TOLERANCE[dtype]:g} against the dequantized KV"
    unscaled = reference(query, quantized_kv_views(cache, spec)[0].double(), batch, layer)
    blind = float((unscaled - expected).norm() / expected.norm())
    return None if blind > 10 * TOLERANCE[dtype] else f"ignoring the scales would pass too ({blind:.3g})"


def scenario_quantized_decode_int8_fp32():
    return attend_quantized([(9, 1), (17, 1), (3, 1)], AttentionLayerSpec(8, 2, 64), 16, torch.float32, "int8", 11)


def scenario_quantized_decode_fp8_e4m3_bf16_split_kv():
    return attend_quantized([(70, 1), (41, 1)], AttentionLayerSpec(8, 2, 64), 16, torch.bfloat16, "fp8_e4m3", 12,
                            force_split=True)


def scenario_quantized_decode_fp8_e5m2_fp16():
    return attend_quantized([(12, 1), (5, 1)], AttentionLayerSpec(4, 4, 32), 4, torch.float16, "fp8_e5m2", 13)


def scenario_quantized_prefill_int8_bf16():
    return attend_quantized([(0, 7), (0, 3)], AttentionLayerSpec(4, 2, 32), 4, torch.bfloat16, "int8", 14)


def scenario_quantized_prefill_fp8_e4m3_fp32():
    return attend_quantized([(0, 9), (0, 2)], AttentionLayerSpec(8, 2, 64), 8, torch.float32, "fp8_e4m3", 15)


def scenario_quantized_prefill_fp8_e5m2_bf16():
    return attend_quantized([(0, 5), (0, 6)], AttentionLayerSpec(2, 1, 64), 16, torch.bfloat16, "fp8_e5m2", 16)


def scenario_quantized_mixed_int8_fp16():
    return attend_quantized([(0, 6), (13, 1), (5, 4)], AttentionLayerSpec(16, 2, 80), 8, torch.float16, "int8", 17)


def scenario_quantized_mixed_fp8_e4m3_fp16():
    return attend_quantized([(0, 5), (21, 1), (7, 3)], AttentionLayerSpec(8, 2, 96), 4, torch.float16, "fp8_e4m3", 18)


def scenario_quantized_mixed_fp8_e5m2_fp32():
    layer = AttentionLayerSpec(4, 2, 64, sliding_window=6, logit_soft_cap=3.0)
    return attend_quantized([(0, 4), (19, 1), (6, 5)], layer, 8, torch.float32, "fp8_e5m2", 19)


def scenario_quantized_every_byte_code_decodes_exactly():
    """Each finite 8-bit code of each storage dtype, times a power-of-two scale, comes out of
    the kernel exactly as torch decodes it: every sequence has one key, so its output is its
    value. Covers signs, subnormals and the largest finite codes of the bit-level decoding."""
    from kvforge.backends.triton_attention import TritonAttentionBackend

    layer = AttentionLayerSpec(1, 1, 32)
    codes = torch.arange(256, dtype=torch.uint8).view(8, 1, 32)  # 8 sequences x 32 dims
    batch = AttentionBatch(torch.arange(9, dtype=torch.int32), torch.ones(8, dtype=torch.int32),
                           torch.zeros(8, dtype=torch.int32), torch.arange(8, dtype=torch.int32).view(8, 1),
                           torch.arange(8), block_size=1, max_query_len=1, max_seq_len=1)
    for name in KV_QUANTIZERS:
        spec = quantized_spec(layer, 1, torch.float32, name)
        cache = torch.zeros(8, spec.layer_block_bytes(), dtype=torch.uint8)
        data, scales = quantized_kv_views(cache, spec)
        values = codes.view(spec.storage_dtype).float()
        stored = torch.where(values.isfinite(), codes, torch.zeros_like(codes))  # no NaN/Inf codes: never written
        data.view(torch.uint8)[:, 1] = stored.view(8, 1, 1, 32)
        scales[:, 0] = 1.0
        scales[:, 1] = 2.0 ** torch.arange(-3, 5, dtype=torch.float32).view(8, 1, 1)
        backend = TritonAttentionBackend(layer, spec, "cpu")
        out = backend.forward(torch.ones(8, 1, 32), cache, backend.plan(batch))  # one key: any query
        expected = stored.view(spec.storage_dtype).float() * scales[:, 1].view(8, 1, 1)
        if not torch.equal(out, expected):
            wrong = (out != expected).nonzero()[0].tolist()
            return f"{name}: code {int(stored[wrong[0], 0, wrong[2]])} decoded to {out[tuple(wrong)]}, not " \
                   f"{expected[tuple(wrong)]}"
    return None


def scenario_quantized_write_kv_stores_what_the_quantizer_returns():
    from kvforge.backends.triton_attention import TritonAttentionBackend

    layer = AttentionLayerSpec(4, 2, 32)
    slots = torch.tensor([7, -1, 0, 14, 12, -1, 3])
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(7, 2, 32, generator=gen) for _ in range(2))
    for name in KV_QUANTIZERS:
        spec = quantized_spec(layer, 4, torch.float32, name)
        cache = torch.randint(0, 256, (5, spec.layer_block_bytes()), dtype=torch.uint8, generator=gen)
        before = cache.clone()
        TritonAttentionBackend(layer, spec, "cpu").write_kv(keys, values, cache, slots)
        data, scales = quantized_kv_views(cache, spec)
        keep = slots >= 0
        for index, x in ((0, keys), (1, values)):
            q = spec.quantizer.quantize(x[keep])
            at = (slots[keep] // 4, index, slots[keep] % 4)
            if not (torch.equal(data[at].view(torch.uint8), q.data.view(torch.uint8))
                    and torch.equal(scales[at], q.scale.squeeze(-1))):
                return f"{name}: slot contents differ from the quantizer's output"
        touched = (cache != before).any(1).nonzero().flatten().tolist()
        if not set(touched) <= {0, 1, 3}:  # blocks of slots 7, 0, 14, 12, 3; -1 must not reach block 4 (or 2)
            return f"{name}: wrote blocks {touched}"
    return None


def scenario_quantized_cache_of_the_wrong_shape_is_refused():
    from kvforge.backends.triton_attention import TritonAttentionBackend

    layer = AttentionLayerSpec(4, 2, 32)
    spec = quantized_spec(layer, 4, torch.float32, "int8")
    backend = TritonAttentionBackend(layer, spec, "cpu")
    batch, query, *_ = make_step([(3, 1)], layer, 4, torch.float32, 0)
    float_cache = torch.zeros(2, 2, 4, 2, 32)
    try:
        backend.forward(query, float_cache, backend.plan(batch))
    except UnsupportedConfigurationError as exc:
        return None if "int8" in str(exc) and "kv_cache_shape()" in str(exc) else f"unclear message: {exc}"
    return "a float NHD cache was read as a quantized one"


def scenario_kernel_decodes_exactly_the_declared_dtypes():
    from kvforge.backends import triton_kernels
    from kvforge.backends.triton_attention import TritonAttentionBackend

    declared, decoded = TritonAttentionBackend.quantized_kv_dtypes, set(triton_kernels.KV_FORMAT_OF_STORAGE)
    return None if declared == decoded else f"declared {sorted(map(str, declared))}, decoded {sorted(map(str, decoded))}"


# Compiling for a GPU needs no GPU: Triton's own ptxas builds Hopper (sm_90) and Ampere (sm_80)
# code here, which checks the compiled path the interpreter never takes (tensor-core dots,
# constexpr globals, fp8 decoding on a GPU without fp8 conversions).

SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}  # bytes per block: A100, H100/H200
COMPILED = {  # label: (dtype, head_size, queries_per_kv, block_q, block_n, split, (soft_cap, window, alibi), warps)
    "bf16 decode, split-KV": ("bf16", 128, 4, 4, 64, True, (False, False, False), 4),
    "fp16 prefill, GQA 8, every feature": ("fp16", 80, 8, 8, 64, False, (True, True, True), 8),
    "fp32 prefill": ("fp32", 128, 1, 64, 32, False, (False, False, False), 8),
}
COMPILED_QUANTIZED = {  # label: (COMPILED configuration it reuses, KV quantizer, compute capability, native fp8)
    "bf16 decode, split-KV, fp8_e4m3 KV, sm_80": ("bf16 decode, split-KV", "fp8_e4m3", 80, False),
    "bf16 decode, split-KV, fp8_e5m2 KV": ("bf16 decode, split-KV", "fp8_e5m2", 90, False),
    "bf16 decode, split-KV, fp8_e4m3 KV, native": ("bf16 decode, split-KV", "fp8_e4m3", 90, True),
    "bf16 decode, split-KV, fp8_e5m2 KV, native": ("bf16 decode, split-KV", "fp8_e5m2", 90, True),
    "fp16 prefill, GQA 8, every feature, int8 KV": ("fp16 prefill, GQA 8, every feature", "int8", 90, False),
}


def compile_for_gpus() -> dict[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvforge.backends import triton_kernels as kernels
    from kvforge.backends.triton_attention import next_power_of_2

    def compile_one(fn, constexprs, pointer, num_warps=4, capability=90):
        def arg_type(name):
            if name in constexprs:
                return "constexpr"
            if name.endswith("_ptr"):
                return pointer(name)
            return "fp32" if name in ("scale", "soft_cap") else "i32"

        signature = {name: arg_type(name) for name in fn.arg_names}
        return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=3))

    def attention_pointer(dtype, quantized):
        return lambda name: ("*u8" if name == "cache_ptr" and quantized
                             else f"*{dtype}" if name in ("q_ptr", "cache_ptr", "out_ptr")
                             else "*fp32" if name in ("scale_ptr", "part_acc_ptr", "part_ml_ptr", "alibi_ptr")
                             else "*i32")

    configurations = {label: (label, None, 90, False) for label in COMPILED} | COMPILED_QUANTIZED
    results = {}
    for label, (base, quantizer_name, capability, native_fp8) in configurations.items():
        dtype, head, qpk, block_q, block_n, split, (cap, window, alibi), warps = COMPILED[base]
        kv_format = kernels.FLOAT_KV.value
        if quantizer_name is not None:
            storage = build_registry().get(QUANTIZER, quantizer_name).cls.storage_dtype
            kv_format = kernels.KV_FORMAT_OF_STORAGE[storage]
        constexprs = dict(HEAD_SIZE=head, HEAD_PAD=next_power_of_2(head), QPK=qpk, QPK_PAD=next_power_of_2(qpk),
                          BLOCK_Q=block_q, BLOCK_N=block_n, PAGE=16, USE_SOFT_CAP=cap, USE_WINDOW=window,
                          USE_ALIBI=alibi, SPLIT=split, DOT_FP32=dtype == "fp32", KV_FORMAT=kv_format,
                          NATIVE_FP8=native_fp8)
        try:
            pointer = attention_pointer(dtype, quantizer_name is not None)
            shared = compile_one(kernels.paged_attention_kernel, constexprs, pointer, warps, capability).metadata.shared
            limit = SHARED_MEMORY[capability]
            results[label] = None if shared <= limit else f"needs {shared} bytes of shared memory (> {limit})"
        except Exception as exc:
            results[label] = f"{type(exc).__name__}: {str(exc)[:500]}"
    others = {"reduce": (kernels.reduce_splits_kernel, dict(HEAD_SIZE=128, HEAD_PAD=128, SPLITS_PAD=8),
                         lambda name: "*bf16" if name == "out_ptr" else "*fp32"),
              "write_kv": (kernels.write_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_SIZE=96, HEADS_PAD=8, HEAD_PAD=128, PAGE=16),
                           lambda name: "*i64" if name == "slot_ptr" else "*fp16")}
    for label, (fn, constexprs, pointer) in others.items():
        try:
            compile_one(fn, constexprs, pointer)
            results[label] = None
        except Exception as exc:
            results[label] = f"{type(exc).__name__}: {str(exc)[:500]}"
    return results


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in dict(globals()).items() if name.startswith("scenario_")}


def run_scenarios() -> dict[str, str | None]:
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn()
        except Exception as exc:  # report, do not stop the other scenarios
            results[name] = f"raised {type(exc).__name__}: {exc}"
    return results


# The tests


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--compile"], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, f"compile run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("label", sorted(COMPILED) + sorted(COMPILED_QUANTIZED) + ["reduce", "write_kv"])
def test_kernels_compile_for_gpus_without_a_gpu(compiled, label):
    assert compiled[label] is None, f"{label}: {compiled[label]}"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_triton_kernels_match_float64_reference_under_interpreter(interpreted, scenario):
    assert interpreted[scenario] is None, f"{scenario}: {interpreted[scenario]}"


def test_is_unavailable_on_cpu_without_interpreter(monkeypatch):
    from kvforge.backends.triton_attention import TritonAttentionBackend

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    availability = TritonAttentionBackend.availability()
    assert not availability.ok and "TRITON_INTERPRET=1" in availability.reason
    assert any("TRITON_INTERPRET=1" in r for r in TritonAttentionBackend.unsupported_reasons(SelectionRequest(device="cpu")))


def test_says_triton_is_not_installed_when_it_is_missing(monkeypatch):
    import importlib.util

    from kvforge.backends.triton_attention import TritonAttentionBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    availability = TritonAttentionBackend.availability()
    assert not availability.ok and "triton not installed" in availability.reason


def test_importing_the_backend_does_not_import_triton():
    code = "import sys, kvforge.backends.triton_attention; print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_auto_never_picks_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    registry = build_registry()
    request = SelectionRequest(device="cpu", dtype=torch.float32, head_size=64, block_size=16, num_heads=4, num_kv_heads=2)
    assert registry.select(ATTENTION_BACKEND, "auto", request).name != "triton"


class PackedUint8Quantizer(Quantizer):
    """A third-party KV quantizer storing codes no Triton kernel here decodes."""

    name = "packed_uint8"
    storage_dtype = torch.uint8
    granularity = PER_TOKEN
    error_bound = 0.1

    def quantize(self, x):
        raise NotImplementedError

    def dequantize(self, q, dtype=None):
        raise NotImplementedError


@pytest.mark.parametrize("quantizer_name", KV_QUANTIZERS)
def test_serves_int8_and_both_fp8_kv_caches(quantizer_name):
    from kvforge.backends.triton_attention import TritonAttentionBackend

    storage = build_registry().select(QUANTIZER, quantizer_name).cls.storage_dtype
    request = SelectionRequest(device="cuda", dtype=torch.bfloat16, head_size=128, block_size=16,
                               num_heads=8, num_kv_heads=2, kv_storage_dtype=storage)
    assert TritonAttentionBackend.unsupported_reasons(request) == []
    assert dtype_name(storage) in TritonAttentionBackend.capabilities()["kv_cache_dtypes"]


def test_refuses_a_kv_storage_dtype_it_cannot_decode_and_names_it():
    from kvforge.backends.triton_attention import TritonAttentionBackend

    reasons = TritonAttentionBackend.unsupported_reasons(SelectionRequest(device="cuda", kv_storage_dtype=torch.uint8))
    assert len(reasons) == 1 and "uint8" in reasons[0] and "float8_e4m3fn" in reasons[0], reasons
    layer = AttentionLayerSpec(8, 2, 128)
    spec = KVCacheSpec(16, 2, 128, torch.bfloat16, quantizer=PackedUint8Quantizer())
    with pytest.raises(UnsupportedConfigurationError, match="quantized to uint8"):
        TritonAttentionBackend(layer, spec, "cuda")  # refused before any kernel or CUDA is touched


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        if importlib.util.find_spec("triton") is None:
            print("triton is not installed")
            sys.exit(3)
        print(json.dumps(compile_for_gpus()))
    else:
        print(json.dumps(run_scenarios()))
