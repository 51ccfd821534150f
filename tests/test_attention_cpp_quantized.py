"""Specification of the `cpp` backend over a quantized KV cache (int8, float8
e4m3fn, float8 e5m2): at every instruction-set level, its output is attention
over the dequantized keys and values (contract guarantee 6) within the float
tolerance of guarantee 3, never reads a block outside the block table, and uses
each (token, KV head) scale where it belongs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    QUANTIZER,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    QuantizationError,
    SelectionRequest,
    build_registry,
    cdiv,
    dequantize_kv_blocks,
    quantized_kv_views,
    write_quantized_kv_by_slot,
)

pytest.importorskip("kvforge.backends.cpp")
from kvforge.backends.cpp import CppAttentionBackend  # noqa: E402
from kvforge.kernels import build  # noqa: E402

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"cpp backend unavailable: {build.missing_tools()}", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_attention_cpp import ISAS, TOLERANCE, isa_or_skip, make_batch, reference_class, relative_error  # noqa: E402

QUANTIZERS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# How far attention over the quantized cache may be from attention over the
# original float keys and values (relative error of the whole output, random
# normal data). Measured worst over the mixed-batch cases at every ISA: int8
# 0.0084, fp8_e4m3 0.032, fp8_e5m2 0.067 (its 2 mantissa bits); about 2x room.
VERSUS_FLOAT = {"int8": 0.02, "fp8_e4m3": 0.06, "fp8_e5m2": 0.12}
POISON = 0xFF  # as bytes: NaN scales, NaN float8 (both formats), -1 int8


@pytest.fixture(autouse=True, scope="module")
def kernel_library():
    build.load()  # isa_or_skip asks the loaded library which path runs


def quantizer(name: str):
    return build_registry().select(QUANTIZER, name).cls()


@dataclass
class Outcome:
    out: torch.Tensor  # the cpp backend's output
    over_dequantized: torch.Tensor  # float64 reference over the dequantized cache
    over_float: torch.Tensor  # float64 reference over the original float keys and values
    cache: torch.Tensor
    spec: KVCacheSpec
    batch: AttentionBatch
    run: object  # () -> a fresh cpp output over `cache` as it now is
    reference: object  # (cache) -> the float64 reference over that cache, dequantized


def run_case(layer, dtype, name, query_lens, context_lens, block_size, seed=0, spare_blocks=3,
             quantizer_instance=None) -> Outcome:
    """One random ragged batch over a quantized cache whose every byte starts as
    POISON: the keys and values of every position of every sequence are written
    through the backend, so all that stays poisoned are the slots past each
    sequence's end and `spare_blocks` blocks no block table names."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(q + c, block_size) for q, c in zip(query_lens, context_lens)) + spare_blocks
    batch = make_batch(query_lens, context_lens, block_size, num_blocks, generator)
    spec = KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, dtype,
                       quantizer=quantizer_instance or quantizer(name))
    backend = CppAttentionBackend(layer, spec)
    cache = torch.full(backend.kv_cache_shape(num_blocks, spec), POISON, dtype=spec.tensor_dtype)

    table = batch.block_table
    every_slot = torch.tensor([int(table[b, pos // block_size]) * block_size + pos % block_size
                               for b, seq_len in enumerate(batch.seq_lens.tolist()) for pos in range(seq_len)])
    shape = (len(every_slot), layer.num_kv_heads, layer.head_size)
    key = torch.randn(shape, generator=generator).to(dtype)
    value = torch.randn(shape, generator=generator).to(dtype)
    backend.write_kv(key, value, cache, every_slot)
    query = torch.randn(batch.num_tokens, layer.num_heads, layer.head_size, generator=generator).to(dtype)
    plan = backend.plan(batch)

    def run():
        out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
        return backend.forward(query, cache, plan, out=out)

    oracle = reference_class()(layer, KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, torch.float64))
    oracle_plan = oracle.plan(batch)

    def reference(kv_cache):
        every_block = torch.arange(num_blocks)
        return oracle.forward(query.double(), dequantize_kv_blocks(kv_cache, spec, every_block, torch.float64),
                              oracle_plan)

    float_cache = torch.zeros(num_blocks, 2, block_size, layer.num_kv_heads, layer.head_size, dtype=torch.float64)
    oracle.write_kv(key.double(), value.double(), float_cache, every_slot)
    return Outcome(run(), reference(cache), oracle.forward(query.double(), float_cache, oracle_plan), cache, spec,
                   batch, run, reference)


def assert_matches(outcome: Outcome, dtype, name):
    assert torch.isfinite(outcome.out).all(), "a poisoned byte was read, or an output element left unwritten"
    assert relative_error(outcome.out, outcome.over_dequantized) <= TOLERANCE[dtype]
    assert relative_error(outcome.out, outcome.over_float) <= VERSUS_FLOAT[name]


# decodes, a fresh prompt of 20 tokens (tiles of 16 tokens x 4 query heads: the
# transposed-key path), a chunk with context, a block-aligned length
MIXED = dict(query_lens=[1, 1, 20, 5, 16], context_lens=[21, 37, 0, 13, 16])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("head_size,block_size", [(32, 1), (64, 16), (128, 32), (40, 16), (80, 32)])
def test_mixed_batch_matches_reference_over_dequantized_kv(monkeypatch, isa, name, head_size, block_size):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=head_size)
    outcome = run_case(layer, torch.float32, name, **MIXED, block_size=block_size, seed=head_size)
    assert_matches(outcome, torch.float32, name)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("feature", ["sliding_window", "logit_soft_cap", "alibi_slopes"])
def test_features_match_reference_over_dequantized_kv(monkeypatch, isa, name, feature):
    isa_or_skip(monkeypatch, isa)
    extra = {"sliding_window": 7, "logit_soft_cap": 4.0, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, **{feature: extra[feature]})
    outcome = run_case(layer, torch.float32, name, [1, 12, 4], [30, 0, 9], block_size=16, seed=3)
    assert_matches(outcome, torch.float32, name)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_compute_dtypes_match_reference_over_dequantized_kv(monkeypatch, isa, name, dtype):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=4, head_size=64)  # no GQA: one query head per KV head
    outcome = run_case(layer, dtype, name, [1, 3, 1], [40, 18, 3], block_size=16, seed=7)
    assert torch.isfinite(outcome.out).all()
    assert relative_error(outcome.out, outcome.over_dequantized) <= TOLERANCE[dtype]
    assert relative_error(outcome.out, outcome.over_float) <= VERSUS_FLOAT[name] + TOLERANCE[dtype]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_blocks_outside_the_block_table_are_never_read(monkeypatch, isa, name):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=1, head_size=64)
    outcome = run_case(layer, torch.float32, name, [1, 1, 6], [40, 9, 3], block_size=16, seed=11, spare_blocks=6)
    batch = outcome.batch
    used = {int(batch.block_table[b, i]) for b, seq_len in enumerate(batch.seq_lens.tolist())
            for i in range((seq_len + 15) // 16)}
    spare = [b for b in range(outcome.cache.shape[0]) if b not in used]
    _, scales = quantized_kv_views(outcome.cache, outcome.spec)
    assert len(spare) == 6 and torch.isnan(scales[spare]).all()  # the poison is really there
    assert torch.isfinite(outcome.out).all()
    assert relative_error(outcome.out, outcome.over_dequantized) <= 1e-5


# A tile that read another slot's or another head's scale would still produce
# plausible numbers; these tests corrupt one scale and see exactly the rows that
# depend on it change, and that the comparison with the reference notices.
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("kv", [0, 1], ids=["key", "value"])
def test_one_wrong_scale_changes_exactly_the_rows_that_read_it(monkeypatch, isa, name, kv):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64)
    outcome = run_case(layer, torch.float32, name, [1, 1], [24, 30], block_size=16, seed=5)
    before = outcome.out
    table = outcome.batch.block_table
    _, scales = quantized_kv_views(outcome.cache, outcome.spec)
    # sequence 0, position 3 (block 0, slot 3), KV head 1 (query heads 2 and 3)
    scales[table[0, 0], kv, 3, 1] *= 8.0
    after = outcome.run()

    changed = (after - before).abs().amax(dim=-1) > 0  # [token, head]
    expected = torch.zeros_like(changed)
    expected[0, 2:] = True  # token 0 is sequence 0's decode
    assert torch.equal(changed, expected)
    # The kernel follows the corrupted scale exactly as the reference does ...
    assert relative_error(after, outcome.reference(outcome.cache)) <= 1e-5
    # ... and the reference comparison catches a kernel that ignored it (the
    # uncorrupted output stands for such a broken kernel).
    assert relative_error(before, outcome.reference(outcome.cache)) > 10 * TOLERANCE[torch.float32]


def test_a_third_party_per_token_quantizer_is_served_through_the_base_write():
    int8 = type(quantizer("int8"))

    class CoarseInt8(int8):
        """int8 that maps the absmax to 100, not 127: other scales, same storage."""

        name = "coarse_int8"
        max_value = 100.0

    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64)
    outcome = run_case(layer, torch.float32, "int8", **MIXED, block_size=16, quantizer_instance=CoarseInt8())
    data, scales = quantized_kv_views(outcome.cache, outcome.spec)
    assert data[torch.isfinite(scales)].abs().max() == 100  # its own scales, not int8's
    assert_matches(outcome, torch.float32, "int8")


def test_selection_serves_the_quantized_dtypes_and_refuses_others_with_reasons():
    request = dict(device="cpu", dtype=torch.float32, head_size=64, block_size=16, num_heads=8, num_kv_heads=2)
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        assert build_registry().select(ATTENTION_BACKEND, "cpp", SelectionRequest(**request, kv_storage_dtype=dtype))
    reasons = CppAttentionBackend.unsupported_reasons(SelectionRequest(**request, kv_storage_dtype=torch.uint8))
    assert len(reasons) == 1 and "uint8" in reasons[0]
    assert all(name in reasons[0] for name in ("float8_e4m3fn", "float8_e5m2", "int8"))  # the valid choices


def test_the_op_refuses_a_quantized_cache_without_scales():
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=16)
    outcome = run_case(layer, torch.float32, "int8", [1], [3], block_size=4)
    data, _ = quantized_kv_views(outcome.cache, outcome.spec)
    plan = CppAttentionBackend(layer, outcome.spec).plan(outcome.batch)
    query = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="needs its kv_scales"):
        torch.ops.kvforge_cpp.paged_attention(query, data, plan.query_start_loc, plan.seq_lens, plan.context_lens,
                                              plan.block_table, 0.25, 0, 0.0, None, torch.empty_like(query))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_every_stored_byte_is_read_as_its_exact_value(monkeypatch, isa, name):
    """A sequence of one token attends with weight exactly 1 to its own value, so
    the output is that value as the kernel dequantized it: one head of 256
    elements holding every byte pattern (NaN and infinity ones set to 0) shows
    each conversion bit-exact, float8 e4m3fn's 2^8 unit included."""
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=1, num_kv_heads=1, head_size=256)
    spec = KVCacheSpec(1, 1, 256, torch.float32, quantizer=quantizer(name))
    backend = CppAttentionBackend(layer, spec)
    batch = make_batch([1], [0], 1, 3, torch.Generator().manual_seed(0))
    cache = torch.zeros(backend.kv_cache_shape(3, spec), dtype=spec.tensor_dtype)
    data, scales = quantized_kv_views(cache, spec)
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    patterns[~torch.isfinite(patterns.view(spec.storage_dtype).float())] = 0
    patterns = patterns.view(spec.storage_dtype)
    block = int(batch.block_table[0, 0])
    data[block, 1, 0, 0] = patterns
    scales[block, :, 0, 0] = 0.125  # a power of two: the products stay exact
    query = torch.randn(1, 1, 256)
    out = backend.forward(query, cache, backend.plan(batch))
    assert torch.equal(out[0, 0], patterns.float() * 0.125)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_the_op_over_quantized_views_passes_opcheck(name):
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=32)
    outcome = run_case(layer, torch.float32, name, [1, 6], [9, 3], block_size=4)
    data, scales = quantized_kv_views(outcome.cache, outcome.spec)
    b = outcome.batch
    query = torch.randn(b.num_tokens, 4, 32)
    args = (query, data, b.query_start_loc, b.seq_lens, b.context_lens, b.block_table, 0.125, 0, 0.0, None,
            torch.empty_like(query), scales)
    checks = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if data.dtype != torch.int8:
        checks.remove("test_schema")  # it multiplies the inputs itself, which torch cannot do in float8
    torch.library.opcheck(torch.ops.kvforge_cpp.paged_attention.default, args, test_utils=checks)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_benchmark_decodes_the_quantized_copy_of_the_data_it_times_unpaged(name):
    # The KV-dtype rows of bench_attention are only comparable if each attends over
    # the same keys and values, quantized, and counts the bytes it must read.
    from kvforge.benchmarks.bench_attention import Shape, backend_call, contiguous_call, workload

    shape = Shape("tiny", 3, 37, 1, 8, 2, 64, 8, torch.float32, name)
    w = workload(shape, "cpu", seed=3)
    paged = backend_call(CppAttentionBackend, w, "cpu")()
    contiguous = contiguous_call(w)().reshape(3, 8, 64)
    assert relative_error(paged, contiguous.double()) <= VERSUS_FLOAT[name]
    assert shape.kv_bytes() == 2 * 3 * 38 * 2 * (64 * 1 + 4)  # one byte per element, a float32 scale per head


def awkward_rows(dtype, generator) -> torch.Tensor:
    """[24, 2, 64] keys or values: normal rows, and rows that test the edges of
    absmax scaling: zeros, one nonzero, constants, subnormal and huge magnitudes,
    and int8 half-way points (a row of amax 127 whose other elements end in .5)."""
    rows = torch.randn(24, 2, 64, generator=generator) * torch.logspace(-3, 3, 24).view(24, 1, 1)
    rows[0] = 0
    rows[1, :, 1:] = 0
    rows[2] = 3.5
    rows[5] = torch.randint(-126, 127, (2, 64), generator=generator) + 0.5  # scale 1: x.5 stays x.5
    rows[5, :, 0] = 127
    rows = rows.to(dtype)
    limits = torch.finfo(dtype)
    rows[3] = (torch.randn(2, 64, generator=generator) * limits.tiny).to(dtype)  # subnormals of `dtype`
    rows[4] = (torch.randn(2, 64, generator=generator).clamp(-4, 4) * (limits.max / 8)).to(dtype)
    assert torch.isfinite(rows).all()
    return rows


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cpp_quantized_write_is_bit_identical_to_the_quantizer(name, dtype):
    generator = torch.Generator().manual_seed(9)
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=64)
    spec = KVCacheSpec(4, 2, 64, dtype, quantizer=quantizer(name))
    backend = CppAttentionBackend(layer, spec)
    assert backend.writes_quantized_in_cpp
    key, value = awkward_rows(dtype, generator), awkward_rows(dtype, generator).flip(0)
    slots = torch.randperm(40, generator=generator)[:24]
    slots[7] = -1
    fast = torch.full(backend.kv_cache_shape(10, spec), POISON, dtype=torch.uint8)
    python = fast.clone()
    backend.write_kv(key, value, fast, slots)
    write_quantized_kv_by_slot(key, value, python, slots, spec)  # the base class's write
    assert torch.equal(fast, python)
    assert not torch.equal(fast, torch.full_like(fast, POISON))


def test_a_nan_key_raises_the_quantizers_error_and_writes_nothing():
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=16)
    spec = KVCacheSpec(4, 2, 16, torch.float32, quantizer=quantizer("int8"))
    backend = CppAttentionBackend(layer, spec)
    cache = torch.zeros(backend.kv_cache_shape(3, spec), dtype=torch.uint8)
    key = torch.randn(3, 2, 16)
    key[2, 1, 5] = float("nan")
    with pytest.raises(QuantizationError, match="int8"):
        backend.write_kv(key, torch.randn(3, 2, 16), cache, torch.tensor([0, 1, 2]))
    assert not cache.any()


def test_only_kvforges_own_quantizers_take_the_cpp_write():
    class Int8Subclass(type(quantizer("int8"))):
        pass  # same name, same arithmetic, yet not the registered class: written through Python

    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=16)
    assert not CppAttentionBackend(layer, KVCacheSpec(4, 2, 16, torch.float32,
                                                      quantizer=Int8Subclass())).writes_quantized_in_cpp
    assert not CppAttentionBackend(layer, KVCacheSpec(4, 2, 16, torch.float32)).writes_quantized_in_cpp


def test_the_quantized_write_op_passes_opcheck():
    spec = KVCacheSpec(4, 2, 16, torch.float32, quantizer=quantizer("int8"))
    cache = torch.zeros(spec.layer_block_bytes() * 3, dtype=torch.uint8).view(3, -1)
    data, scales = quantized_kv_views(cache, spec)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    torch.library.opcheck(torch.ops.kvforge_cpp.write_quantized_kv.default,
                          (key, value, data, scales, torch.tensor([0, 3, -1, 9, 4])))


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("block_size,kv_heads,head_size", [(1, 1, 32), (16, 4, 64), (32, 3, 40)])
def test_the_backends_fast_views_are_the_cores_views(name, block_size, kv_heads, head_size):
    from kvforge.backends.cpp.quantized_views import QuantizedViews

    spec = KVCacheSpec(block_size, kv_heads, head_size, torch.float32, quantizer=quantizer(name))
    whole = torch.randint(0, 256, (8, spec.layer_block_bytes()), dtype=torch.uint8)
    # the cache alone, and the cache as rows of a larger tensor (as models/huge_pages.py lays out layers)
    for cache in (whole[:5].clone(), whole[3:]):
        for fast, core in zip(QuantizedViews(spec).views(cache), quantized_kv_views(cache, spec)):
            assert (fast.dtype, fast.shape, fast.stride(), fast.data_ptr()) == (
                core.dtype, core.shape, core.stride(), core.data_ptr())
    with pytest.raises(ValueError, match=rf"uint8 tensor \[num_blocks, {spec.layer_block_bytes()}\]"):
        QuantizedViews(spec).views(cache[:, 1:])


@pytest.mark.parametrize("name", QUANTIZERS)
def test_two_threads_give_the_one_thread_result(name):
    # Each thread pulls tiles from a shared counter into its own scratch buffers.
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64)
    one = run_case(layer, torch.float32, name, **MIXED, block_size=16, seed=13)
    torch.set_num_threads(2)  # the autouse fixture restores it
    two = one.run()
    assert torch.allclose(two, one.out, rtol=1e-6, atol=1e-6)
    assert relative_error(two, one.over_dequantized) <= 1e-5
