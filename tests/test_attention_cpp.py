"""Specification of the `cpp` attention backend: its custom ops and its results
against the float64 `reference` backend on random ragged batches."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
    cdiv,
)

cpp = pytest.importorskip("kvforge.backends.cpp")
from kvforge.backends.cpp import CppAttentionBackend  # noqa: E402
from kvforge.kernels import build  # noqa: E402

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"cpp backend unavailable: {build.missing_tools()}", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference_class():
    return build_registry().get(ATTENTION_BACKEND, "reference").cls


def make_batch(query_lens, context_lens, block_size, num_blocks, generator):
    """A ragged batch whose sequences own randomly chosen, shuffled physical blocks."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    needs = [cdiv(s, block_size) for s in seq_lens]
    assert sum(needs) <= num_blocks
    physical = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), max(needs) + 1, dtype=torch.int32)
    slots, used = [], 0
    for b, (need, ctx, q) in enumerate(zip(needs, context_lens, query_lens)):
        table[b, :need] = physical[used:used + need]
        used += need
        for pos in range(ctx, ctx + q):
            slots.append(int(table[b, pos // block_size]) * block_size + pos % block_size)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return AttentionBatch(
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def run_case(layer, dtype, query_lens, context_lens, block_size, seed=0):
    """The cpp backend's output and the float64 reference's on one random batch."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(q + c, block_size) for q, c in zip(query_lens, context_lens)) + 3
    batch = make_batch(query_lens, context_lens, block_size, num_blocks, generator)
    spec = KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, dtype)
    backend = CppAttentionBackend(layer, spec)
    cache = torch.randn(backend.kv_cache_shape(num_blocks, spec), generator=generator).to(dtype)
    tokens = batch.num_tokens
    key = torch.randn(tokens, layer.num_kv_heads, layer.head_size, generator=generator).to(dtype)
    value = torch.randn(tokens, layer.num_kv_heads, layer.head_size, generator=generator).to(dtype)
    query = torch.randn(tokens, layer.num_heads, layer.head_size, generator=generator).to(dtype)
    backend.write_kv(key, value, cache, batch.slot_mapping)
    out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
    backend.forward(query, cache, backend.plan(batch), out=out)

    oracle = reference_class()(layer, KVCacheSpec(block_size, layer.num_kv_heads, layer.head_size, torch.float64))
    expected = oracle.forward(query.double(), cache.double(), oracle.plan(batch))
    return out, expected


def relative_error(out, expected):
    return float((out.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_mixed_prefill_and_decode_matches_float64_reference(dtype, heads, kv_heads):
    layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=64)
    # decodes, a fresh prompt, a chunk with context, a block-aligned length
    out, expected = run_case(layer, dtype, [1, 1, 9, 5, 16], [20, 31, 0, 13, 16], block_size=8)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= TOLERANCE[dtype]


def test_decode_tiles_on_two_threads_give_the_one_thread_result():
    # A decode tile claims the tile it runs next before it starts (to fetch its keys
    # ahead): with two threads pulling tiles, every tile must still run exactly once.
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64)
    query_lens, context_lens = [40] + [1] * 13, [0] + [3 + 11 * i for i in range(13)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, expected = run_case(layer, torch.float32, query_lens, context_lens, block_size=16, seed=4)
        torch.set_num_threads(2)
        two, _ = run_case(layer, torch.float32, query_lens, context_lens, block_size=16, seed=4)
    finally:
        torch.set_num_threads(threads)
    assert relative_error(two, expected) <= TOLERANCE[torch.float32]
    assert torch.equal(one, two)  # each tile is one thread's work, in one order


ISAS = ["baseline", "avx2", "avx512"]


def isa_or_skip(monkeypatch, isa: str) -> None:
    """Cap the kernel's instruction set at `isa`, or skip where this CPU lacks it."""
    monkeypatch.setenv("KVFORGE_CPP_ISA", isa)
    if torch.ops.kvforge_cpp.isa() != isa:
        pytest.skip(f"this CPU has no {isa} path (runs {torch.ops.kvforge_cpp.isa()})")


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_matches_reference(monkeypatch, isa):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=80)
    for dtype in TOLERANCE:
        out, expected = run_case(layer, dtype, [1, 9, 3], [17, 0, 6], block_size=8, seed=5)
        assert relative_error(out, expected) <= TOLERANCE[dtype]


def test_portable_switch_still_selects_the_baseline(monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_PORTABLE", "1")
    assert torch.ops.kvforge_cpp.isa() == "baseline"


# The AVX-512 tile against the generic one: decodes, short chunks, block sizes
# below, at and above its 16-key groups, every head size it serves, windows that
# cut groups, and a long context.
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256, 288])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_tiles_match_reference_on_every_block_and_head_size(monkeypatch, isa, head_size, block_size):
    isa_or_skip(monkeypatch, isa)
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=head_size)
    out, expected = run_case(layer, torch.float32, [1, 1, 3, 4, 1], [0, 47, 29, 16, 130], block_size, seed=head_size)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7, 16])
def test_tiles_with_windows_and_16_bit_caches_match_reference(monkeypatch, dtype, window):
    isa_or_skip(monkeypatch, "avx512")
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=4, head_size=64, sliding_window=window)
    out, expected = run_case(layer, dtype, [1, 2, 1, 3], [40, 18, 3, 33], block_size=16, seed=7)
    assert relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("head_size", [80, 96, 128, 40])
def test_head_sizes_that_are_not_a_multiple_of_the_vector_width_work(head_size):
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=head_size)
    out, expected = run_case(layer, torch.float32, [1, 7, 3], [33, 0, 5], block_size=16, seed=1)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("block_size", [1, 32])
def test_long_prefill_spanning_many_query_tiles_matches_reference(block_size):
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=1, head_size=64)
    out, expected = run_case(layer, torch.float32, [150, 1], [40, 70], block_size=block_size, seed=2)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("feature", ["sliding_window", "logit_soft_cap", "alibi_slopes"])
def test_declared_features_match_reference(feature):
    extra = {"sliding_window": 5, "logit_soft_cap": 4.0, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, **{feature: extra[feature]})
    out, expected = run_case(layer, torch.float32, [1, 12, 4], [30, 0, 9], block_size=4, seed=3)
    assert relative_error(out, expected) <= 1e-5


def test_write_kv_touches_only_the_mapped_slots_and_skips_minus_one():
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=16)
    spec = KVCacheSpec(4, 2, 16, torch.float32)
    backend = CppAttentionBackend(layer, spec)
    cache = torch.zeros(backend.kv_cache_shape(6, spec))
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    backend.write_kv(key, value, cache, torch.tensor([13, -1, 2]))
    expected = torch.zeros_like(cache)
    expected[3, 0, 1], expected[3, 1, 1] = key[0], value[0]
    expected[0, 0, 2], expected[0, 1, 2] = key[2], value[2]
    assert torch.equal(cache, expected)


def test_write_kv_refuses_a_slot_outside_the_cache_without_writing():
    spec = KVCacheSpec(4, 1, 8, torch.float32)
    backend = CppAttentionBackend(AttentionLayerSpec(num_heads=1, num_kv_heads=1, head_size=8), spec)
    cache = torch.zeros(backend.kv_cache_shape(2, spec))
    with pytest.raises(RuntimeError, match="outside the cache"):
        backend.write_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), cache, torch.tensor([0, 8]))
    assert not cache.any()


def test_refuses_float64_with_reasons():
    reasons = CppAttentionBackend.unsupported_reasons(SelectionRequest(device="cpu", dtype=torch.float64))
    assert reasons and "dtype" in reasons[0]
    with pytest.raises(UnsupportedConfigurationError, match="dtype"):
        CppAttentionBackend(AttentionLayerSpec(2, 2, 64), KVCacheSpec(16, 2, 64, torch.float64))


def test_every_kernel_source_is_hashed_into_the_build_folder_name(tmp_path, monkeypatch):
    # torch's own rebuild check ignores headers: a header left out of the digest
    # would let an edited kernel load the stale library.
    on_disk = {p.name for p in build.HERE.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {p.name for p in build.SOURCES + build.HEADERS}
    header = tmp_path / "decode_tile.h"
    header.write_text(build.HEADERS[-1].read_text())
    monkeypatch.setattr(build, "HEADERS", build.HEADERS[:-1] + [header])
    before = build.build_dir()
    header.write_text(header.read_text() + "\n// edited\n")
    assert build.build_dir() != before


def test_a_killed_builds_lock_is_removed_and_a_running_ones_kept(tmp_path):
    # torch waits for its lock file to vanish: one left by a killed build would
    # make every later load wait forever; one younger than a build may be live.
    lock = tmp_path / "lock"
    lock.write_text("")
    now = lock.stat().st_mtime
    assert not build.clear_stale_lock(tmp_path, now=now + 60) and lock.exists()
    assert build.clear_stale_lock(tmp_path, now=now + build.STALE_LOCK_S + 1) and not lock.exists()
    assert not build.clear_stale_lock(tmp_path)  # none there: nothing to do


def test_availability_names_the_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "kvforge-no-such-compiler")
    monkeypatch.setattr(build, "cached_library", lambda: None)
    monkeypatch.setattr(build, "_loaded", None)
    available = CppAttentionBackend.availability()
    assert not available.ok and available.reason.startswith("no C++ compiler")


def opcheck_inputs(dtype):
    generator = torch.Generator().manual_seed(4)
    batch = make_batch([1, 6], [9, 3], 4, 8, generator)
    cache = torch.randn(8, 2, 4, 2, 32, generator=generator).to(dtype)
    query = torch.randn(batch.num_tokens, 4, 32, generator=generator).to(dtype)
    key = torch.randn(batch.num_tokens, 2, 32, generator=generator).to(dtype)
    return batch, cache, query, key


def test_auto_prefers_cpp_over_sdpa_on_cpu():
    request = SelectionRequest(device="cpu", dtype=torch.float16, head_size=128, block_size=16,
                               num_heads=8, num_kv_heads=2)
    assert build_registry().select(ATTENTION_BACKEND, "auto", request).name == "cpp"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    build.load()
    batch, cache, query, key = opcheck_inputs(dtype)
    torch.library.opcheck(torch.ops.kvforge_cpp.write_kv.default, (key, key.clone(), cache, batch.slot_mapping))
    args = (query, cache, batch.query_start_loc, batch.seq_lens, batch.context_lens, batch.block_table,
            0.125, 0, 0.0, None, torch.empty_like(query))
    torch.library.opcheck(torch.ops.kvforge_cpp.paged_attention.default, args)
