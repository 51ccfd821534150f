"""The `flashinfer` and `xformers` backends on a machine without CUDA: they say why
they are unavailable without importing their libraries, `auto` never picks them,
and their pure-Python parts (FlashInfer's plan arguments, xformers' paged bias
over the interleaved-page view of our cache) are right. Their kernels are
validated only on a GPU, by the conformance suite (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import dataclasses
import json
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
    SelectionError,
    SelectionRequest,
    UnsupportedConfigurationError,
    build_registry,
    dtype_name,
)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
MODULES = {"flashinfer": "kvforge.backends.flashinfer_backend", "xformers": "kvforge.backends.xformers_backend"}


def small_batch() -> AttentionBatch:
    """Three sequences, block size 4: a prefill (0 + 6), a decode (9 + 1), a chunk (4 + 3)."""
    return AttentionBatch(
        query_start_loc=torch.tensor([0, 6, 7, 10], dtype=torch.int32),
        seq_lens=torch.tensor([6, 10, 7], dtype=torch.int32),
        context_lens=torch.tensor([0, 9, 4], dtype=torch.int32),
        block_table=torch.tensor([[5, 2, 0], [7, 1, 4], [3, 6, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([20, 21, 22, 23, 8, 9, 17, 24, 25, 26], dtype=torch.int64),
        block_size=4, max_query_len=6, max_seq_len=10)


@no_cuda
@pytest.mark.parametrize("library", sorted(MODULES))
def test_reports_needs_cuda_without_importing_the_library(library):
    code = (f"import sys, {MODULES[library]} as m\n"
            f"cls = m.kvforge_implementations()[0]\n"
            f"a = cls.availability()\n"
            f"print(json.dumps([a.ok, a.reason, {library!r} in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ok, reason, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert not ok and reason.startswith("needs CUDA (") , reason
    assert not imported, f"importing the backend or checking its availability imported {library}"


@no_cuda
@pytest.mark.parametrize("name", sorted(MODULES))
def test_auto_never_picks_it_on_cpu_and_naming_it_says_why(name, monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    registry = build_registry()
    request = SelectionRequest(device="cpu", dtype=torch.float16, head_size=128, block_size=16, num_heads=8, num_kv_heads=2)
    assert registry.select(ATTENTION_BACKEND, "auto", request).name not in MODULES
    with pytest.raises(SelectionError, match="needs CUDA"):
        registry.select(ATTENTION_BACKEND, name, request)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_declares_cuda_only_and_half_precision(name):
    cls = build_registry().get(ATTENTION_BACKEND, name).cls
    assert cls.devices == frozenset({"cuda"})
    assert cls.dtypes == frozenset({torch.float16, torch.bfloat16})
    assert any("float32" in r for r in cls.unsupported_reasons(SelectionRequest(device="cuda", dtype=torch.float32)))


@pytest.mark.parametrize("quantizer_name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_refuses_a_per_token_quantized_kv_cache_naming_why_and_the_way_out(name, quantizer_name):
    """Neither library reads per-(token, KV head) scales: declaring them would compute
    wrongly. (FlashInfer reads fp8 with one scale per layer: tests/test_flashinfer_fp8_kv.py.)"""
    cls = build_registry().get(ATTENTION_BACKEND, name).cls
    quantizer = build_registry().get(QUANTIZER, quantizer_name).cls()
    storage = dtype_name(quantizer.storage_dtype)
    request = SelectionRequest(device="cuda", dtype=torch.bfloat16, head_size=128, block_size=16, num_heads=8,
                               num_kv_heads=2, kv_storage_dtype=quantizer.storage_dtype,
                               kv_scale_granularity="per_token")
    reasons = cls.unsupported_reasons(request)
    why = f"quantized to {storage}" if quantizer.storage_dtype not in cls.quantized_kv_dtypes else "per_token scales"
    assert any(why in r for r in reasons), reasons
    assert any("'triton'" in r for r in reasons), reasons
    assert cls.unsupported_reasons(dataclasses.replace(request, kv_storage_dtype=None)) == []
    spec = KVCacheSpec(16, 2, 128, torch.bfloat16, quantizer=quantizer)
    with pytest.raises(UnsupportedConfigurationError, match=why):
        cls(AttentionLayerSpec(8, 2, 128), spec, "cuda")  # refused before the library is imported or CUDA touched


def test_flashinfer_prefill_plan_arguments_are_the_csr_view_of_the_batch():
    from kvforge.backends.flashinfer_backend import plan_arguments

    layer = AttentionLayerSpec(8, 2, 128, sliding_window=16, logit_soft_cap=30.0)
    args = plan_arguments(small_batch(), layer, torch.bfloat16)
    assert args["qo_indptr"].tolist() == [0, 6, 7, 10]
    assert args["paged_kv_indptr"].tolist() == [0, 2, 5, 7]
    assert args["paged_kv_indices"].tolist() == [5, 2, 7, 1, 4, 3, 6]
    assert args["paged_kv_last_page_len"].tolist() == [2, 2, 3]
    assert all(args[k].dtype == torch.int32 for k in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                                                      "paged_kv_last_page_len"))
    assert (args["num_qo_heads"], args["num_kv_heads"], args["head_dim_qk"], args["page_size"]) == (8, 2, 128, 4)
    assert args["causal"] is True and args["sm_scale"] == pytest.approx(128 ** -0.5)
    assert args["window_left"] == 15  # 16 positions including the query's own
    assert args["logits_soft_cap"] == 30.0
    assert args["q_data_type"] == args["kv_data_type"] == torch.bfloat16


def test_flashinfer_plan_arguments_without_window_or_cap():
    from kvforge.backends.flashinfer_backend import decode_plan_arguments, is_pure_decode, plan_arguments

    layer = AttentionLayerSpec(4, 4, 64)
    assert plan_arguments(small_batch(), layer, torch.float16)["window_left"] == -1
    assert plan_arguments(small_batch(), layer, torch.float16)["logits_soft_cap"] is None
    decode = AttentionBatch(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32),
                            torch.tensor([4, 7], dtype=torch.int32), torch.tensor([[3, 1], [0, 2]], dtype=torch.int32),
                            torch.tensor([5, 11]), block_size=4, max_query_len=1, max_seq_len=8)
    assert is_pure_decode(decode) and not is_pure_decode(small_batch())
    args = decode_plan_arguments(decode, layer, torch.float16)
    assert args["indptr"].tolist() == [0, 2, 4] and args["indices"].tolist() == [3, 1, 0, 2]
    assert args["last_page_len"].tolist() == [1, 4]
    assert (args["num_qo_heads"], args["num_kv_heads"], args["head_dim"], args["page_size"]) == (4, 4, 64, 4)


def test_xformers_bias_arguments_double_the_block_table():
    from kvforge.backends.xformers_backend import bias_arguments

    args = bias_arguments(small_batch())
    assert args["q_seqlen"] == [6, 1, 3] and args["kv_seqlen"] == [6, 10, 7] and args["page_size"] == 4
    assert args["block_tables"].dtype == torch.int32
    assert args["block_tables"].tolist() == [[10, 4, 0], [14, 2, 8], [6, 12, 0]]


def test_xformers_paged_views_read_keys_and_values_in_place():
    from kvforge.backends.xformers_backend import paged_key_value

    cache = torch.randn(6, 2, 4, 2, 8)
    keys, values = paged_key_value(cache)
    assert keys.shape == values.shape == (1, 11 * 4, 2, 8)
    assert keys.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    for block in range(6):
        assert torch.equal(keys[0, 8 * block:8 * block + 4], cache[block, 0])
        assert torch.equal(values[0, 8 * block:8 * block + 4], cache[block, 1])


def test_xformers_paged_bias_over_our_cache_gives_the_reference_attention():
    """Materialise xformers' own paged causal bias (CPU) over the interleaved-page view
    and attend densely: the layout trick and the causal offset must match `reference`."""
    attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")
    from kvforge.backends.xformers_backend import bias_arguments, paged_key_value

    batch = small_batch()
    layer = AttentionLayerSpec(4, 2, 16)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 2, 4, 2, 16, generator=gen, dtype=torch.float64)
    query = torch.randn(10, 4, 16, generator=gen, dtype=torch.float64)
    bias = attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(**bias_arguments(batch),
                                                                                   device=torch.device("cpu"))
    keys, values = paged_key_value(cache)
    logical_rows = batch.num_seqs * batch.block_table.shape[1] * batch.block_size  # xformers' unpaged view
    mask = bias.materialize((10, logical_rows), dtype=torch.float64)  # [tokens, physical rows in use]
    rows = mask.shape[-1]
    k = keys[0, :rows].repeat_interleave(2, dim=1).transpose(0, 1)  # [heads, rows, d]
    v = values[0, :rows].repeat_interleave(2, dim=1).transpose(0, 1)
    scores = query.transpose(0, 1) @ k.transpose(1, 2) * layer.softmax_scale + mask
    out = (scores.softmax(-1) @ v).transpose(0, 1)
    reference = build_registry().get(ATTENTION_BACKEND, "reference").cls(layer, KVCacheSpec(4, 2, 16, torch.float64))
    expected = reference.forward(query, cache, reference.plan(batch))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


SIGNATURES = """
import inspect, torch
from kvforge.backends.flashinfer_backend import decode_plan_arguments, plan_arguments
from kvforge.backends.xformers_backend import bias_arguments
from kvforge.core import AttentionBatch, AttentionLayerSpec
import flashinfer
from xformers.ops import fmha
i32 = lambda v: torch.tensor(v, dtype=torch.int32)
batch = AttentionBatch(i32([0, 6, 7, 10]), i32([6, 10, 7]), i32([0, 9, 4]), i32([[5, 2, 0], [7, 1, 4], [3, 6, 0]]),
                       torch.arange(10), block_size=4, max_query_len=6, max_seq_len=10)
layer = AttentionLayerSpec(8, 2, 128, sliding_window=16, logit_soft_cap=30.0)
prefill, decode = flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper
inspect.signature(prefill.plan).bind(None, **plan_arguments(batch, layer, torch.float16))
inspect.signature(getattr(decode, "_plan_impl", decode.plan)).bind(None, **decode_plan_arguments(batch, layer, torch.float16))
inspect.signature(prefill.run).bind(None, None, None, out=None)
inspect.signature(decode.run).bind(None, None, None, out=None)
bias = fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
inspect.signature(bias.from_seqlens).bind(**bias_arguments(batch), device=torch.device("cpu"))
inspect.signature(fmha.memory_efficient_attention_forward).bind(None, None, None, attn_bias=None, scale=1.0)
print("ok")
"""


def test_calls_match_the_installed_libraries_signatures():
    """The keyword arguments the wrappers pass are ones the installed FlashInfer and
    xformers accept (their kernels cannot run here, their signatures can be checked)."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("xformers") is None:
        pytest.skip("flashinfer-python and xformers are not both installed")
    done = subprocess.run([sys.executable, "-c", SIGNATURES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@no_cuda
def test_gpu_check_script_stops_with_a_message_without_cuda(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "out")})
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists(), "it should stop before running or writing anything"
