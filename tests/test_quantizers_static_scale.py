"""Static-scale fp8 KV quantizers (`fp8_e4m3_per_tensor`, `fp8_e5m2_per_tensor`):
what they do, how the KV cache stores them (one key and one value scale per
layer in the existing scale slots), `cache.kv_scales` (a number, or "calibrate"
per layer on its first write), and that the conformance checks catch broken ones."""

from __future__ import annotations

import pytest
import torch

from kvforge.conformance import check_quantizer_roundtrip as roundtrip
from kvforge.conformance import check_quantizer_static_scale as static
from kvforge.conformance.attention_cases import SEED_ENV
from kvforge.core import (
    PER_TENSOR,
    QUANTIZER,
    ConfigError,
    KVCacheSpec,
    QuantizationError,
    StaticScaleQuantizer,
    build_registry,
    load_config,
    quantized_kv_views,
    write_quantized_kv_by_slot,
)
from tests.planted.static_quantizers import (
    ClaimsAWiderRange,
    OverflowsToNaN,
    RescalesEachWrite,
    SaturatesToInf,
)

STATIC = {"fp8_e4m3_per_tensor": (torch.float8_e4m3fn, 448.0, 2.0 ** -6, 2.0 ** -4),
          "fp8_e5m2_per_tensor": (torch.float8_e5m2, 57344.0, 2.0 ** -14, 2.0 ** -3)}


@pytest.fixture(autouse=True)
def pinned_seed(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "4321")


def quantizer(name: str, scale: float | None = 1.0) -> StaticScaleQuantizer:
    return build_registry(environ={}).get(QUANTIZER, name).cls(scale)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_registered_with_its_format_and_declared_static_and_kv_capable(name):
    storage, format_max, smallest_normal, bound = STATIC[name]
    cls = build_registry(environ={}).get(QUANTIZER, name).cls
    assert (cls.storage_dtype, cls.granularity, cls.max_value, cls.smallest_normal, cls.error_bound) == (
        storage, PER_TENSOR, format_max, smallest_normal, bound)
    assert cls.static_scale and cls.kv_capable()
    assert cls.capabilities()["static_scale"] is True and cls.capabilities()["kv_capable"] is True
    q = cls(0.5)
    assert (q.saturation_limit, q.precise_from) == (0.5 * format_max, 0.5 * smallest_normal)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_quantizes_by_the_fixed_scale_and_saturates_beyond_its_range(name):
    storage, format_max, _, bound = STATIC[name]
    q = quantizer(name, 0.25)
    x = torch.tensor([0.0, 1.0, -3.0, 0.25 * format_max, 2 * 0.25 * format_max, -1e30])
    got = q.quantize(x)
    assert got.data.dtype == storage and got.scale.item() == 0.25 and got.scale.dtype == torch.float32
    back = q.dequantize(got, torch.float64)
    limit = 0.25 * format_max
    assert back.tolist()[:2] == [0.0, 1.0]  # 1 / 0.25 = 4 is exact in both formats
    assert back[3].item() == limit and back[4].item() == limit and back[5].item() == -limit
    assert abs(back[2].item() + 3.0) <= bound * 3.0


@pytest.mark.parametrize("name", sorted(STATIC))
def test_worst_error_inside_the_range_reaches_half_an_ulp_and_stays_under_the_bound(name):
    _, format_max, _, bound = STATIC[name]
    q = quantizer(name, 1.0)
    x = torch.linspace(1.0, 2.0, 4097)  # one binade, finely: the worst relative rounding error is in it
    relative = ((q.dequantize(q.quantize(x), torch.float64) - x.double()).abs() / x.double()).max().item()
    assert 0.9 * bound / (1 + bound) <= relative <= bound


def test_an_invalid_or_missing_scale_is_a_clear_error():
    with pytest.raises(QuantizationError, match="finite positive"):
        quantizer("fp8_e4m3_per_tensor", -1.0)
    with pytest.raises(QuantizationError, match="finite positive"):
        quantizer("fp8_e4m3_per_tensor", float("inf"))
    template = quantizer("fp8_e4m3_per_tensor", None)
    assert not template.calibrated
    with pytest.raises(QuantizationError, match="'fp8_e4m3_per_tensor' has no scale yet"):
        template.quantize(torch.ones(3))


# The KV cache layout

def test_kv_write_stores_each_layer_scale_in_every_slot_and_keys_and_values_apart():
    q = quantizer("fp8_e4m3_per_tensor")
    spec = KVCacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, quantizer=q,
                       kv_scales=(0.5, 0.01))
    assert spec.bytes_per_block() == KVCacheSpec(4, 2, 8, torch.float32, quantizer=build_registry(
        environ={}).get(QUANTIZER, "fp8_e4m3").cls()).bytes_per_block()  # the same layout as per-token fp8
    cache = torch.zeros(3, spec.layer_block_bytes(), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 8, generator=gen) * 10, torch.randn(5, 2, 8, generator=gen)
    value[0, 0, 0] = 100.0  # beyond the value scale's limit (4.48): saturates
    slots = torch.tensor([0, 5, -1, 9, 11])
    write_quantized_kv_by_slot(key, value, cache, slots, spec)
    data, scales = quantized_kv_views(cache, spec)
    blocks, offsets = slots[slots >= 0] // 4, slots[slots >= 0] % 4
    assert bool((scales[blocks, 0, offsets] == 0.5).all()) and bool((scales[blocks, 1, offsets] == 0.01).all())
    assert int((scales != 0).sum()) == 4 * 2 * 2  # 4 written tokens x 2 heads x (key, value); nothing else
    back = data[blocks].float() * scales[blocks].unsqueeze(-1)
    keys_back = back[torch.arange(4), 0, offsets]
    values_back = back[torch.arange(4), 1, offsets]
    kept = slots >= 0
    assert torch.allclose(keys_back, key[kept], rtol=2 ** -4, atol=0.5 * 2 ** -10)
    assert values_back[0, 0, 0].item() == pytest.approx(0.01 * 448, rel=1e-6)  # saturated, finite
    assert torch.allclose(values_back.reshape(-1)[1:], value[kept].reshape(-1)[1:], rtol=2 ** -4,
                          atol=0.01 * 2 ** -10)


# cache.kv_scales

def test_kv_scales_takes_a_positive_number_or_calibrate():
    assert load_config(cache={"kv_scales": 0.02}).config.cache.kv_scales == 0.02
    assert load_config(cache={"kv_scales": "calibrate"}).config.cache.kv_scales == "calibrate"
    assert load_config().config.cache.kv_scales == 1.0  # vLLM's default k_scale / v_scale
    for bad in (0.0, -1.0, "auto"):
        with pytest.raises(ConfigError, match="kv_scales"):
            load_config(cache={"kv_scales": bad})


def test_engine_gives_the_configured_scale_or_a_template_to_calibrate():
    from kvforge.engine.components import resolve_kv_quantizer

    registry = build_registry(environ={})
    config = load_config(cache={"kv_cache_dtype": "fp8_e4m3_per_tensor", "kv_scales": 0.125}).config
    assert resolve_kv_quantizer(registry, config).scale == 0.125
    config = load_config(cache={"kv_cache_dtype": "fp8_e5m2_per_tensor", "kv_scales": "calibrate"}).config
    assert resolve_kv_quantizer(registry, config).scale is None


def test_calibrate_fixes_each_layer_scales_on_the_first_prefill_and_keeps_them(tmp_path):
    """Per layer, from its first write's largest key and value (x2 headroom); a later,
    larger prompt saturates rather than rescaling; the cache's slots hold the constants."""
    from kvforge import LLM, SamplingParams
    from kvforge.models.base import PagedAttention

    llm = LLM(model="kvforge-tiny", device="cpu", dtype="float32",
              cache={"kv_cache_dtype": "fp8_e4m3_per_tensor", "kv_scales": "calibrate", "num_blocks": 64,
                     "enable_prefix_caching": False})
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    float_llm = LLM(model="kvforge-tiny", device="cpu", dtype="float32", cache={"num_blocks": 64})
    prompt = list(range(5, 25))
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    assert list(out) == list(float_llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
                             .outputs[0].token_ids)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, PagedAttention)]
    scales = [layer.kv_scales for layer in layers]
    assert all(s is not None and s[0] > 0 and s[1] > 0 for s in scales)
    assert len(set(scales)) == len(scales), "each layer calibrates on its own keys and values"
    llm.generate(prompt_token_ids=[list(range(30, 90))], sampling_params=params)
    assert [layer.kv_scales for layer in layers] == scales, "scales are fixed after the first prefill"
    spec = llm.engine.model.kv_cache_spec(llm.engine.kv.block_size)
    for cache, (key_scale, value_scale) in zip(llm.engine.runner.kv_caches, scales):
        _, slot_scales = quantized_kv_views(cache, spec)
        for index, scale in ((0, key_scale), (1, value_scale)):
            written = slot_scales[:, index][slot_scales[:, index] != 0]
            assert written.numel() >= 20 and bool((written == scale).all()), "every slot holds its layer's scale"


# The checks catch broken static-scale quantizers

def test_a_scale_that_changes_between_writes_is_caught():
    with pytest.raises(AssertionError, match="not the fixed one"):
        static.test_the_returned_scale_is_the_fixed_one_whatever_the_data(RescalesEachWrite(), torch.float32)
    with pytest.raises(AssertionError, match="other codes than inside the whole tensor"):
        static.test_each_code_depends_on_its_element_alone(RescalesEachWrite(), torch.float32)


@pytest.mark.parametrize("cls", [OverflowsToNaN, SaturatesToInf], ids=lambda c: c.name)
def test_saturation_that_returns_nan_or_inf_is_caught(cls):
    with pytest.raises(AssertionError, match="Inf or NaN"):
        static.test_values_beyond_the_range_saturate_to_the_limit_never_inf_or_nan(cls(), torch.float32)
    with pytest.raises(AssertionError, match="outside error_bound"):  # the round trip at 1e4 and 1e30 too
        roundtrip.test_group_maxima_at_the_edges_of_float32_round_trip_within_the_bound(cls(), torch.float32)


def test_a_saturation_limit_that_is_claimed_but_not_kept_is_caught():
    with pytest.raises(AssertionError, match="outside error_bound"):
        static.test_round_trip_keeps_the_bound_inside_the_range_at_every_scale(ClaimsAWiderRange(), torch.float32)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_the_builtins_pass_the_static_scale_group(name):
    q = quantizer(name)
    for dtype in (torch.float32, torch.bfloat16):
        static.test_the_returned_scale_is_the_fixed_one_whatever_the_data(q, dtype)
        static.test_each_code_depends_on_its_element_alone(q, dtype)
        static.test_round_trip_keeps_the_bound_inside_the_range_at_every_scale(q, dtype)
        static.test_values_beyond_the_range_saturate_to_the_limit_never_inf_or_nan(q, dtype)
    static.test_a_calibrated_scale_holds_the_sample_and_an_uncalibrated_template_refuses(q)
