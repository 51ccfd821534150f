"""The `triton` attention backend, run under Triton's interpreter on the CPU.

`TRITON_INTERPRET=1` must be set before triton is first imported, and the test
suite shares one process, so the kernel checks run once in a subprocess (this
file run as a script) and each test asserts one scenario's outcome. Shapes are
tiny: the interpreter takes about a second per launch.
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
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionRequest,
    build_registry,
)

# Scenarios run in the subprocess; each returns an error message or None


def make_step(lengths, layer, block_size, dtype, seed, values_seed=None):
    """A random step: (batch, query, new keys/values, cache holding garbage and the context,
    unused blocks NaN). Physical blocks are a random permutation; `values_seed` draws other
    values for the same batch (another layer)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in lengths]
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


# Compiling for a GPU needs no GPU: Triton's own ptxas builds Hopper (sm_90) code here,
# which checks the compiled path the interpreter never takes (tensor-core dots, constexpr globals).

HOPPER_SHARED_MEMORY = 227 * 1024
COMPILED = {  # label: (dtype, head_size, queries_per_kv, block_q, block_n, split, (soft_cap, window, alibi), warps)
    "bf16 decode, split-KV": ("bf16", 128, 4, 4, 64, True, (False, False, False), 4),
    "fp16 prefill, GQA 8, every feature": ("fp16", 80, 8, 8, 64, False, (True, True, True), 8),
    "fp32 prefill": ("fp32", 128, 1, 64, 32, False, (False, False, False), 8),
}


def compile_for_hopper() -> dict[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvforge.backends import triton_kernels as kernels
    from kvforge.backends.triton_attention import next_power_of_2

    def compile_one(fn, constexprs, pointer, num_warps=4):
        def arg_type(name):
            if name in constexprs:
                return "constexpr"
            if name.endswith("_ptr"):
                return pointer(name)
            return "fp32" if name in ("scale", "soft_cap") else "i32"

        signature = {name: arg_type(name) for name in fn.arg_names}
        return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=3))

    def attention_pointer(dtype):
        return lambda name: (f"*{dtype}" if name in ("q_ptr", "cache_ptr", "out_ptr")
                             else "*fp32" if name in ("part_acc_ptr", "part_ml_ptr", "alibi_ptr") else "*i32")

    results = {}
    for label, (dtype, head, qpk, block_q, block_n, split, (cap, window, alibi), warps) in COMPILED.items():
        constexprs = dict(HEAD_SIZE=head, HEAD_PAD=next_power_of_2(head), QPK=qpk, QPK_PAD=next_power_of_2(qpk),
                          BLOCK_Q=block_q, BLOCK_N=block_n, PAGE=16, USE_SOFT_CAP=cap, USE_WINDOW=window,
                          USE_ALIBI=alibi, SPLIT=split, DOT_FP32=dtype == "fp32")
        try:
            shared = compile_one(kernels.paged_attention_kernel, constexprs, attention_pointer(dtype), warps).metadata.shared
            results[label] = None if shared <= HOPPER_SHARED_MEMORY else f"needs {shared} bytes of shared memory"
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


@pytest.mark.parametrize("label", sorted(COMPILED) + ["reduce", "write_kv"])
def test_kernels_compile_for_hopper_without_a_gpu(compiled, label):
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


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        if importlib.util.find_spec("triton") is None:
            print("triton is not installed")
            sys.exit(3)
        print(json.dumps(compile_for_hopper()))
    else:
        print(json.dumps(run_scenarios()))
