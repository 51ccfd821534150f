"""The prefill tiles of the cpp backend (kernels/prefill_tile.h on AVX-512,
kernels/prefill_tile_avx2.h on AVX2), each on its own ISA level, against the
float64 reference: long prompts across many blocks, key tiles that straddle
blocks, GQA groups that fill 16 to 64 lanes, rows that leave lanes empty,
sliding windows that cut key tiles, soft-cap, ALiBi, chunks with context, 16-bit
and quantized caches, several threads. Each case is checked twice: with the
prefill tile and with KVFORGE_CPP_PREFILL=off (the older tiles), and the two
must differ in rounding, which shows the new tile is what ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvforge.core import AttentionLayerSpec

pytest.importorskip("kvforge.backends.cpp")
from kvforge.kernels import build  # noqa: E402

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"cpp backend unavailable: {build.missing_tools()}", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import test_attention_cpp_quantized as quantized  # noqa: E402
from test_attention_cpp import TOLERANCE, isa_or_skip, relative_error, run_case  # noqa: E402


@pytest.fixture(autouse=True, params=["avx512", "avx2"])
def level(monkeypatch, request):
    build.load()
    isa_or_skip(monkeypatch, request.param)
    return request.param


def both_tiles(monkeypatch, case):
    """case() with the prefill tile, then with the older tiles: (new, old, expected)."""
    monkeypatch.setenv("KVFORGE_CPP_PREFILL", "on")
    new, expected = case()
    monkeypatch.setenv("KVFORGE_CPP_PREFILL", "off")
    old, _ = case()
    monkeypatch.delenv("KVFORGE_CPP_PREFILL")
    return new, old, expected


def check(monkeypatch, layer, dtype, query_lens, context_lens, block_size, seed=0, distinct=True):
    new, old, expected = both_tiles(
        monkeypatch, lambda: run_case(layer, dtype, query_lens, context_lens, block_size, seed=seed))
    assert torch.isfinite(new).all(), "an output element left unwritten"
    assert relative_error(new, expected) <= TOLERANCE[dtype]
    assert relative_error(old, expected) <= TOLERANCE[dtype]
    if dtype == torch.float32 and distinct:
        assert not torch.equal(new, old), "the prefill tile did not run"


# (heads, kv_heads): lanes per tile 64 (1, 4 and 8 query heads per KV head) and 48 (3)
GROUPS = [(4, 4), (8, 2), (8, 1), (6, 2)]


@pytest.mark.parametrize("heads,kv_heads", GROUPS)
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_long_prompts_over_many_blocks_match_reference(monkeypatch, heads, kv_heads, block_size):
    layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=64)
    # 300 tokens: tiles that end mid key tile; 21: a tile of 21 rows leaves lanes empty; a decode beside them
    check(monkeypatch, layer, torch.float32, [300, 21, 1], [0, 0, 40], block_size, seed=block_size)


@pytest.mark.parametrize("head_size", [16, 32, 48, 128, 256])
def test_every_head_size_it_serves_matches_reference(monkeypatch, head_size):
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=head_size)
    check(monkeypatch, layer, torch.float32, [97, 40], [0, 0], 16, seed=head_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_queries_and_caches_match_reference(monkeypatch, dtype):
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=4, head_size=64)
    check(monkeypatch, layer, dtype, [130, 33], [0, 0], 16, seed=4)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (6, 2)])
def test_bfloat16_pairs_of_keys_across_blocks_match_reference(monkeypatch, block_size, heads, kv_heads):
    # With AVX-512 BF16 the value sums take keys two by two: odd block sizes put
    # a pair's keys in different blocks, odd key counts leave a pair half padding,
    # and chunks with context start key tiles mid-block.
    layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=64)
    check(monkeypatch, layer, torch.bfloat16, [131, 37, 1], [0, 29, 60], block_size, seed=block_size + heads)


@pytest.mark.parametrize("extra", [{"sliding_window": 33}, {"logit_soft_cap": 2.0},
                                   {"alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}])
def test_bfloat16_windows_soft_cap_and_alibi_match_reference(monkeypatch, extra):
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, **extra)
    check(monkeypatch, layer, torch.bfloat16, [120, 30], [0, 45], 8, seed=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steep_scores_whose_maximum_keeps_jumping_match_reference(monkeypatch, dtype):
    # A scale of 12 puts scores hundreds apart: each row's running maximum jumps by
    # more than the slack the tile allows before it rescales, and by more than
    # e^x can bear in float32 (88), so a tile that never rescaled would overflow.
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, scale=12.0)
    check(monkeypatch, layer, dtype, [200, 40], [0, 70], 16, seed=13)


def test_chunks_with_context_match_reference(monkeypatch):
    # chunked prefill: the chunk's rows see the whole context and their own causal part
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64)
    check(monkeypatch, layer, torch.float32, [64, 40, 17], [100, 33, 250], 16, seed=6)


@pytest.mark.parametrize("window", [1, 5, 31, 32, 33, 100])
def test_sliding_windows_that_cut_key_tiles_match_reference(monkeypatch, window):
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=window)
    # a window of 1 leaves each row its own value, exactly, on either tile
    check(monkeypatch, layer, torch.float32, [150, 20], [0, 60], 16, seed=window, distinct=window > 1)


@pytest.mark.parametrize("feature", ["logit_soft_cap", "alibi_slopes"])
def test_soft_cap_and_alibi_match_reference(monkeypatch, feature):
    extra = {"logit_soft_cap": 2.0, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, **{feature: extra[feature]})
    check(monkeypatch, layer, torch.float32, [120, 30], [0, 45], 8, seed=8)


@pytest.mark.parametrize("name", quantized.QUANTIZERS)
def test_quantized_caches_match_reference_over_dequantized_kv(monkeypatch, name):
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64)
    monkeypatch.setenv("KVFORGE_CPP_PREFILL", "on")
    outcome = quantized.run_case(layer, torch.float32, name, [90, 20, 1], [0, 40, 50], 16, seed=9)
    quantized.assert_matches(outcome, torch.float32, name)
    monkeypatch.setenv("KVFORGE_CPP_PREFILL", "off")
    assert not torch.equal(outcome.run(), outcome.out), "the prefill tile did not run"


def test_two_threads_give_the_one_thread_result(monkeypatch):
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_case(layer, torch.float32, [200, 70], [0, 30], 16, seed=10)
        torch.set_num_threads(2)
        two, _ = run_case(layer, torch.float32, [200, 70], [0, 30], 16, seed=10)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each tile is one thread's work, in one order


def test_a_bad_switch_value_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_PREFILL", "maybe")
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=1, head_size=64)
    with pytest.raises(RuntimeError, match="KVFORGE_CPP_PREFILL must be on or off, got 'maybe'"):
        run_case(layer, torch.float32, [20], [0], 16)


def test_flops_convention_counts_each_visible_pair_once():
    from kvforge.benchmarks.prefill_attention import prefill_flops

    # a causal prompt of 3 tokens sees 1 + 2 + 3 = 6 (query, key) pairs; 4 * d FLOPs each, per head
    assert prefill_flops([3], num_heads=1, head_size=2) == 6 * 4 * 2
    assert prefill_flops([3, 1], num_heads=2, head_size=2) == (6 + 1) * 4 * 2 * 2


def test_the_gflops_figure_reports_both_tiles_and_the_gemm_peak():
    from kvforge.benchmarks.prefill_attention import markdown, measure

    result = measure([40], num_heads=2, num_kv_heads=1, head_size=16, dtypes=("float32",), threads=1, repeats=1)
    entry = result["dtypes"]["float32"]
    assert entry["after"]["gflops"] > 0 and entry["before"]["gflops"] > 0 and result["gemm_gflops"] > 0
    assert entry["fraction_of_gemm"] == entry["after"]["gflops"] / result["gemm_gflops"]
    from kvforge.benchmarks.machine import gemm_kernels

    # the peak is the best of every GEMM kernel here, as the machine section takes it
    assert set(result["gemm_kernels"]) == set(gemm_kernels())
    assert result["gemm_gflops"] == max(result["gemm_kernels"].values())
    assert "KVFORGE_CPP_PREFILL" not in __import__("os").environ  # the switch is put back
    assert "| float32 |" in "\n".join(markdown(result))


def test_the_check_catches_a_row_missing_one_key():
    # The planted result: what a tile that skips one key too many would give (the
    # last row of a 300-token prompt without its first key: the float64
    # reference with a window of 299). The tolerance the cases above use fails it,
    # while the kernel's own output passes.
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64)
    out, expected = run_case(layer, torch.float32, [300], [0], 16, seed=11)
    windowed = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=299)
    _, planted = run_case(windowed, torch.float32, [300], [0], 16, seed=11)  # the same inputs: same seed, shapes
    assert relative_error(out, expected) <= TOLERANCE[torch.float32]
    assert relative_error(planted.float(), expected) > TOLERANCE[torch.float32]
    assert (planted - expected).abs().amax(dim=(1, 2)).nonzero().flatten().tolist() == [299]  # one row differs


@pytest.mark.parametrize("head_size", [8, 24, 40])
def test_head_sizes_in_steps_of_8_take_the_avx2_tile(monkeypatch, level, head_size):
    if level != "avx2":
        pytest.skip("the AVX-512 tile serves head sizes in steps of 16")
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=head_size)
    check(monkeypatch, layer, torch.float32, [97, 40], [0, 0], 16, seed=head_size)
