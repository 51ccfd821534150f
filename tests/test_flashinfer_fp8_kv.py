"""The `flashinfer` backend over a static-scale fp8 KV cache, checked without a GPU:
what it declares and refuses, and what it hands FlashInfer's wrappers. A fake
`flashinfer` module stands in at the API boundary; its `run` computes what
FlashInfer documents for fp8 KV (keys times `k_scale`, values times `v_scale`) from
exactly the views and floats it was given, and must match the `reference`
backend reading the same cache through its scale slots. The real kernels have
not been run with fp8 KV on a GPU (benchmarks/gpu_check.sh would)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    PER_TENSOR,
    PER_TOKEN,
    QUANTIZER,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    SelectionRequest,
    build_registry,
    quantized_kv_views,
)

REQUEST = dict(device="cuda", dtype=torch.bfloat16, head_size=64, block_size=4, num_heads=4, num_kv_heads=2)


def registry():
    return build_registry(environ={})


def flashinfer_cls():
    return registry().get(ATTENTION_BACKEND, "flashinfer").cls


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_declares_fp8_kv_with_per_tensor_scales_only(storage):
    cls = flashinfer_cls()
    assert storage in cls.quantized_kv_dtypes and cls.kv_scale_granularities == frozenset({PER_TENSOR})
    assert cls.unsupported_reasons(SelectionRequest(**REQUEST, kv_storage_dtype=storage,
                                                    kv_scale_granularity=PER_TENSOR)) == []
    per_token = cls.unsupported_reasons(SelectionRequest(**REQUEST, kv_storage_dtype=storage,
                                                         kv_scale_granularity=PER_TOKEN))
    assert any("per_token scales" in r and "'fp8_e4m3_per_tensor'" in r for r in per_token), per_token
    assert cls.unsupported_reasons(SelectionRequest(**{**REQUEST, "device": "cpu"}, kv_storage_dtype=storage,
                                                    kv_scale_granularity=PER_TENSOR))  # CUDA only
    assert cls.capabilities()["kv_scale_granularities"] == [PER_TENSOR]


def test_backends_reading_scale_slots_serve_static_scale_quantizers_too():
    for name in ("reference", "sdpa", "cpp", "triton"):
        cls = registry().get(ATTENTION_BACKEND, name).cls
        assert cls.kv_scale_granularities == frozenset({PER_TOKEN, PER_TENSOR}), name
        assert torch.float8_e4m3fn in cls.quantized_kv_dtypes, name


def test_plugins_explain_names_the_per_tensor_way_out_for_flashinfer():
    from kvforge.cli_plugins import report
    from kvforge.core import load_config

    from kvforge.cli_plugins import selection_request

    config = load_config(device="cuda", dtype="bfloat16", cache={"kv_cache_dtype": "fp8_e4m3"}).config
    data = report(registry(), selection_request(config, registry()), True)
    (flashinfer,) = [c for c in data["explain"][ATTENTION_BACKEND]["candidates"] if c["name"] == "flashinfer"]
    assert "per_token scales" in flashinfer["why_not"] and "fp8_e4m3_per_tensor" in flashinfer["why_not"]


class FakeWrapper:
    """Records `plan` and `run`; `run` attends as FlashInfer documents, over the given views."""

    def __init__(self, *args, **kwargs):
        self.plans, self.runs = [], []
        self.batch = None  # set by the test: the kernel's view of the plan

    def plan(self, **kwargs):
        self.plans.append(kwargs)

    def run(self, q, paged_kv_cache, *, out, k_scale=None, v_scale=None):
        self.runs.append({"q": q, "paged_kv_cache": paged_kv_cache, "k_scale": k_scale, "v_scale": v_scale})
        keys, values = paged_kv_cache
        as_float = torch.stack((keys.float() * k_scale, values.float() * v_scale), dim=1)
        layer = self.layer
        reference = registry().get(ATTENTION_BACKEND, "reference").cls(
            layer, KVCacheSpec(keys.shape[1], keys.shape[2], keys.shape[3], torch.float32))
        out.copy_(reference.forward(q.float(), as_float, reference.plan(self.batch)).to(out.dtype))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper,
                                   BatchDecodeWithPagedKVCacheWrapper=FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    from kvforge.backends import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "workspace", lambda device: torch.empty(0, dtype=torch.uint8))
    return module


def batch(block_size: int, decode: bool) -> AttentionBatch:
    if decode:  # two sequences, one new token each
        return AttentionBatch(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32),
                              torch.tensor([5, 2], dtype=torch.int32),
                              torch.tensor([[4, 1], [2, 0]], dtype=torch.int32), torch.tensor([17, 10]),
                              block_size=block_size, max_query_len=1, max_seq_len=6)
    return AttentionBatch(torch.tensor([0, 6, 7], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32),
                          torch.tensor([0, 2], dtype=torch.int32), torch.tensor([[4, 1], [2, 0]], dtype=torch.int32),
                          torch.tensor([16, 17, 18, 19, 4, 5, 10]), block_size=block_size, max_query_len=6,
                          max_seq_len=6)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("name", ["fp8_e4m3_per_tensor", "fp8_e5m2_per_tensor"])
def test_passes_fp8_views_and_the_layer_scales_and_attends_as_the_slots_say(fake_flashinfer, name, decode):
    quantizer = registry().get(QUANTIZER, name).cls(0.05)
    layer = AttentionLayerSpec(4, 2, 64)
    spec = KVCacheSpec(4, 2, 64, torch.bfloat16, quantizer=quantizer)
    backend = flashinfer_cls()(layer, spec, "cuda")
    layer_view = backend.with_kv_scales((0.03, 0.007))  # a layer calibrated to its own scales
    assert layer_view.prefill_wrapper is backend.prefill_wrapper  # shares the planned wrappers
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(type(backend).kv_cache_shape(6, spec), dtype=spec.tensor_dtype)
    step = batch(4, decode)
    slots = torch.arange(24)[torch.tensor([16, 17, 18, 19, 4, 5, 8, 9, 10])]  # every position of both sequences
    keys, values = torch.randn(len(slots), 2, 64, generator=gen), torch.randn(len(slots), 2, 64, generator=gen) * 0.1
    for wrapper in (backend.prefill_wrapper, backend.decode_wrapper):
        wrapper.batch, wrapper.layer = step, layer
    plan = backend.plan(step)
    wrapper = backend.decode_wrapper if decode else backend.prefill_wrapper
    (planned,) = wrapper.plans
    assert planned["kv_data_type"] == quantizer.storage_dtype and planned["q_data_type"] == torch.bfloat16
    query = torch.randn(step.num_tokens, 4, 64, generator=gen).to(torch.bfloat16)
    for view, scales in ((backend, (0.05, 0.05)), (layer_view, (0.03, 0.007))):
        view.write_kv(keys.to(torch.bfloat16), values.to(torch.bfloat16), cache, slots)
        got = view.forward(query, cache, plan)
        run = wrapper.runs[-1]
        assert (run["k_scale"], run["v_scale"]) == pytest.approx(scales, rel=1e-6)
        assert isinstance(run["k_scale"], float) and isinstance(run["v_scale"], float)  # host floats: no sync
        k_view, v_view = run["paged_kv_cache"]
        assert k_view.dtype == v_view.dtype == quantizer.storage_dtype
        assert k_view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()  # in place, no copy
        assert k_view.stride() == v_view.stride() and k_view.stride(0) == spec.layer_block_bytes()
        reference = registry().get(ATTENTION_BACKEND, "reference").cls(layer, view.cache)
        expected = reference.forward(query, cache, reference.plan(step))
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        _, slot_scales = quantized_kv_views(cache, spec)
        assert slot_scales[4, 0, 0, 0].item() == pytest.approx(scales[0]) and \
            slot_scales[4, 1, 0, 0].item() == pytest.approx(scales[1])


# The conformance group catches a per-tensor backend that takes the wrong scales

class PerTensorLikeFlashInfer(registry().get(ATTENTION_BACKEND, "reference").cls):
    """Reads only the fp8 codes and one key and one value scale per layer, as FlashInfer does."""

    name = "per-tensor-like-flashinfer"
    kv_scale_granularities = frozenset({PER_TENSOR})

    def scales(self) -> tuple[float, float]:
        return self.cache.kv_scales_or_default()

    def forward(self, query, kv_cache, plan, out=None):
        data, _ = quantized_kv_views(kv_cache, self.cache)
        key_scale, value_scale = self.scales()
        as_float = torch.stack((data[:, 0].float() * key_scale, data[:, 1].float() * value_scale), dim=1)
        spec = KVCacheSpec(self.cache.block_size, self.cache.num_kv_heads, self.cache.head_size, torch.float32)
        inner = registry().get(ATTENTION_BACKEND, "reference").cls(self.layer, spec)
        got = inner.forward(query.float(), as_float, plan)
        return got.to(query.dtype) if out is None else out.copy_(got)


class TakesTheDefaultScale(PerTensorLikeFlashInfer):
    """Passes the quantizer's own scale for keys and values, not the layer's."""

    name = "takes-the-default-scale"

    def scales(self) -> tuple[float, float]:
        return self.cache.quantizer.scale, self.cache.quantizer.scale


def test_a_backend_taking_the_default_scale_instead_of_the_layer_scales_is_caught(monkeypatch):
    from kvforge.conformance import check_attention_quantized_kv as quantized_kv
    from kvforge.conformance.attention_cases import SEED_ENV
    from kvforge.core import Registration

    monkeypatch.setenv(SEED_ENV, "77")
    for cls, broken in ((PerTensorLikeFlashInfer, False), (TakesTheDefaultScale, True)):
        registration = Registration(ATTENTION_BACKEND, cls.name, cls, "test", "test", "0", (1, 2))
        if broken:
            with pytest.raises(AssertionError, match="fp8_e4m3_per_tensor"):
                quantized_kv.test_quantized_kv_matches_reference_over_dequantized_values(
                    registration, "decode", torch.float32)
        else:
            quantized_kv.test_quantized_kv_matches_reference_over_dequantized_values(
                registration, "decode", torch.float32)
