"""The `sdpa` attention backend: PyTorch SDPA over the paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvforge.backends.sdpa as sdpa_module
from kvforge.backends.sdpa import SdpaAttentionBackend
from kvforge.conformance.attention_cases import Target, check_case, make_case, make_layer, mismatch, oracle, run_step
from kvforge.core import (
    ATTENTION_BACKEND,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
)

SDPA = Target(SdpaAttentionBackend, "cpu", reduced=False)


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(q, k, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_on_a_step_of_prompts_chunks_drafts_and_decodes(dtype):
    lengths = [(0, 7), (12, 1), (30, 4), (5, 1), (17, 9), (0, 1)]  # (context, new): drafts = 4 new over context
    case = make_case("mixed", make_layer(64, 4), 8, dtype, seed=11, lengths=lengths)
    assert check_case(SDPA, case) is None


@pytest.mark.parametrize("layer", [
    make_layer(80, 8, sliding_window=5),
    make_layer(64, 1, alibi=True),
    make_layer(96, 4, sliding_window=9, alibi=True),
], ids=["window", "alibi", "window+alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_and_alibi_match_reference(layer, dtype):
    lengths = [(40, 1), (0, 12), (25, 6), (70, 1)]
    case = make_case("mixed", layer, 16, dtype, seed=12, lengths=lengths)
    assert check_case(SDPA, case) is None


def test_decodes_of_similar_length_share_one_sdpa_call(sdpa_calls):
    lengths = [(c, 1) for c in (30, 25, 41, 28, 22)]
    case = make_case("decode", make_layer(64, 4), 16, torch.float32, seed=13, lengths=lengths)
    run_step(SdpaAttentionBackend(case.layer, case.cache_spec()), case, "cpu")
    assert len(sdpa_calls) == 1
    (num_decodes, kv_heads, packed_heads, _), (_, _, keys, _) = sdpa_calls[0]
    assert (num_decodes, kv_heads, packed_heads) == (5, 2, 4)  # query heads packed per KV head
    assert keys == 42  # padded to the longest sequence


def test_decodes_of_very_different_lengths_are_split_to_bound_padding(sdpa_calls):
    lengths = [(c, 1) for c in (399, 11, 389, 2, 9)]
    case = make_case("decode", make_layer(64, 4), 16, torch.float32, seed=16, lengths=lengths)
    assert check_case(SDPA, case) is None
    sdpa_calls.clear()
    run_step(SdpaAttentionBackend(case.layer, case.cache_spec()), case, "cpu")
    assert sorted((q[0], k[2]) for q, k in sdpa_calls) == [(1, 3), (2, 12), (2, 400)]  # (decodes, keys) per call


def test_sliding_window_decodes_gather_only_the_window(sdpa_calls):
    lengths = [(c, 1) for c in (300, 250, 3)]
    case = make_case("decode", make_layer(64, 4, sliding_window=16), 8, torch.float32, seed=17, lengths=lengths)
    assert check_case(SDPA, case) is None
    assert sorted((q[0], k[2]) for q, k in sdpa_calls) == [(1, 4), (2, 16)]


def test_each_multi_token_sequence_gets_its_own_call(sdpa_calls):
    lengths = [(0, 5), (3, 1), (9, 4), (2, 1)]
    case = make_case("mixed", make_layer(64, 1), 8, torch.float32, seed=14, lengths=lengths)
    run_step(SdpaAttentionBackend(case.layer, case.cache_spec()), case, "cpu")
    assert len(sdpa_calls) == 3  # one for both decodes, one per multi-token sequence


def test_never_reads_blocks_outside_the_block_table():
    # make_case leaves a few physical blocks unreferenced and fills them with NaN;
    # block-table padding is 0, which may well be one of them.
    case = make_case("mixed", make_layer(64, 2), 8, torch.float32, seed=15,
                     lengths=[(1, 1), (40, 1), (0, 3), (33, 5)])
    out = run_step(SdpaAttentionBackend(case.layer, case.cache_spec()), case, "cpu")
    assert torch.isfinite(out).all()


def test_refuses_logit_soft_cap_with_the_reason():
    with pytest.raises(UnsupportedConfigurationError, match="logit_soft_cap"):
        SdpaAttentionBackend(AttentionLayerSpec(4, 2, 64, logit_soft_cap=30.0), KVCacheSpec(16, 2, 64, torch.float32))


def test_is_registered_and_preferred_over_reference_by_auto():
    registry = build_registry(allow=["reference", "sdpa"], environ={})
    assert registry.get(ATTENTION_BACKEND, "sdpa").cls is SdpaAttentionBackend
    chosen = registry.select(ATTENTION_BACKEND, "auto", SelectionRequest(device="cpu", dtype=torch.bfloat16,
                                                                         head_size=128, block_size=16))
    assert chosen.name == "sdpa"
    soft_capped = SelectionRequest(device="cpu", dtype=torch.float32, head_size=64,
                                   features=frozenset({"logit_soft_cap"}))
    assert registry.select(ATTENTION_BACKEND, "auto", soft_capped).name == "reference"


@pytest.mark.parametrize("query_len, context_len", [(1, 37), (9, 0)], ids=["decode", "prefill"])
def test_benchmark_pages_the_same_data_it_copies_contiguously(query_len, context_len):
    # The paging-overhead ratio is only meaningful if both sides compute the same thing.
    from kvforge.benchmarks.bench_attention import Shape, backend_call, contiguous_call, workload

    shape = Shape("tiny", 3, context_len, query_len, 8, 2, 64, 8, torch.float32)
    w = workload(shape, "cpu", seed=3)
    paged = backend_call(SdpaAttentionBackend, w, "cpu")()
    contiguous = contiguous_call(w)()  # [seqs, kv_heads, group, d] or [seqs, heads, q, d]
    if query_len == 1:
        contiguous = contiguous.reshape(3, 8, 64)
    else:
        contiguous = contiguous.transpose(1, 2).reshape(3 * query_len, 8, 64)
    torch.testing.assert_close(paged, contiguous, rtol=1e-5, atol=1e-5)


def test_reuses_its_gather_buffer_across_steps_of_different_sizes():
    layer = make_layer(64, 4)
    backend = SdpaAttentionBackend(layer, make_case("decode", layer, 8, torch.float32, seed=0).cache_spec())
    for seed, kind in enumerate(["long", "decode", "mixed", "prefill"]):
        case = make_case(kind, layer, 8, torch.float32, seed=20 + seed)
        assert mismatch(run_step(backend, case, "cpu"), oracle(case), case) is None
    assert backend.scratch is not None
