"""Conformance of every `quantizer`: what it declares and what it returns
(guarantees 2 and 4 of `kvforge.core.Quantizer`, and the linear `data * scale`
map hosts rely on to dequantize inside their own kernels).

KV-capable quantizers are the `per_token` ones and the static-scale ones: the KV
cache keeps one float32 scale per (token, KV head), which they fill (a static
scale: its constant in every slot), so only they may be named by
`cache.kv_cache_dtype`, and only they are stored here through the cache's block
layout. Other `per_channel` and `per_tensor` quantizers are checked as weight or
tensor quantizers.
"""

import dataclasses
import re

import pytest
import torch

from kvforge.conformance.applicability import not_applicable
from kvforge.conformance.attention_cases import fresh_seed
from kvforge.conformance.quantizer_cases import (
    INPUT_DTYPES,
    describe,
    group_amax,
    kv_capable,
    magnitudes_per_group,
    random_input,
    same_bits,
    scale_problem,
    shapes,
)
from kvforge.core import (
    GRANULARITIES,
    PER_TENSOR,
    PER_TOKEN,
    QUANTIZER,
    KVCacheSpec,
    QuantizationError,
    dequantize_kv_blocks,
    quantized_kv_views,
    write_quantized_kv_by_slot,
)

KIND = QUANTIZER
GROUP = "contract"


@pytest.fixture
def quantizer(registration):
    return registration.cls()


def scale_shape_problem(granularity: str, shape: tuple[int, ...], scale: torch.Tensor) -> str | None:
    """What is wrong with the scale's shape for an input of `shape`, or None."""
    if granularity == PER_TENSOR:
        return None if scale.numel() == 1 else f"{scale.numel()} scales; expected one element"
    expected = (*shape[:-1], 1) if granularity == PER_TOKEN else (shape[0], 1)
    return None if tuple(scale.shape) == expected else f"scale shape {tuple(scale.shape)}; expected {expected}"


def test_declares_a_storage_dtype_a_known_granularity_and_an_error_bound_in_0_1(registration):
    cls = registration.cls
    assert isinstance(cls.storage_dtype, torch.dtype), (
        f"{cls.name}: storage_dtype {cls.storage_dtype!r} is not a torch.dtype")
    assert cls.granularity in GRANULARITIES, (
        f"{cls.name}: granularity {cls.granularity!r} is not one of {sorted(GRANULARITIES)}")
    bound = cls.error_bound
    assert isinstance(bound, float) and 0.0 < bound < 1.0, (
        f"{cls.name}: error_bound {bound!r} must be a float in (0, 1): the worst round-trip error relative to a "
        "scale group's largest magnitude")
    capabilities = cls.capabilities()
    assert (capabilities["granularity"], capabilities["error_bound"]) == (cls.granularity, bound)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_quantize_returns_storage_dtype_data_of_the_input_shape_and_scales_of_the_granularity_shape(quantizer, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        x = torch.randn(shape, generator=gen).to(dtype)
        q = quantizer.quantize(x)
        assert q.data.dtype == quantizer.storage_dtype, (
            f"{quantizer.name}: data is {q.data.dtype}, but storage_dtype declares {quantizer.storage_dtype}")
        assert tuple(q.data.shape) == shape, f"{quantizer.name}: data shape {tuple(q.data.shape)} for input {shape}"
        problem = scale_problem(quantizer, q, describe(x, "normal data", seed))
        assert problem is None, problem
        problem = scale_shape_problem(quantizer.granularity, shape, q.scale)
        assert problem is None, f"{quantizer.name} ({quantizer.granularity}), input {shape}: {problem}"
        assert q.original_dtype == dtype, f"{quantizer.name}: original_dtype {q.original_dtype} for a {dtype} input"


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_dequantize_returns_the_input_dtype_by_default_and_the_dtype_asked_for(quantizer, dtype):
    gen = torch.Generator().manual_seed(fresh_seed())
    shape = shapes(quantizer)[0]
    q = quantizer.quantize(torch.randn(shape, generator=gen).to(dtype))
    assert quantizer.dequantize(q).dtype == dtype, f"{quantizer.name}: dequantize(q) is not the input's {dtype}"
    for asked in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        back = quantizer.dequantize(q, asked)
        assert back.dtype == asked and tuple(back.shape) == shape, (
            f"{quantizer.name}: dequantize(q, {asked}) gave {back.dtype} {tuple(back.shape)}")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_dequantize_is_data_times_scale(quantizer, dtype):
    """Backends dequantize a KV cache themselves as `data.float() * scale`, knowing
    only the storage dtype; a zero point or a non-linear code would be misread."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        x = torch.randn(shape, generator=gen).to(dtype) * 3
        q = quantizer.quantize(x)
        linear = q.data.to(torch.float32) * q.scale
        got = quantizer.dequantize(q, torch.float32)
        close = (got - linear).abs() <= 1e-6 * linear.abs()
        assert bool(close.all()), (
            f"{quantizer.name}: {describe(x, 'normal data', seed)}: dequantize differs from data * scale at "
            f"{int((~close).sum())} elements (e.g. {got[~close][0].item():.6g} vs {linear[~close][0].item():.6g})")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_nan_or_infinity_anywhere_raises_a_quantization_error_naming_the_quantizer(quantizer, bad, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        numel = torch.Size(shape).numel()
        for position in (int(torch.randint(0, numel, (1,), generator=gen)), numel - 1):  # a check of row 0 alone fails
            x = torch.randn(shape, generator=gen).to(dtype)
            x.view(-1)[position] = bad
            with pytest.raises(QuantizationError, match=re.escape(quantizer.name)):
                quantizer.quantize(x)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_the_same_input_quantizes_to_identical_data_and_scales_and_is_left_unchanged(quantizer, dtype):
    """Also when the same values come in another memory layout (a transposed copy)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        x = (torch.randn(shape, generator=gen) * 10).to(dtype)
        kept = x.clone()
        first, second, of_copy = quantizer.quantize(x), quantizer.quantize(x), quantizer.quantize(x.clone())
        assert same_bits(x, kept), f"{quantizer.name}: quantize changed its input ({describe(x, 'normal', seed)})"
        strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # the same values in another memory layout
        for other in (second, of_copy, quantizer.quantize(strided)):
            assert same_bits(first.data, other.data) and same_bits(first.scale, other.scale), (
                f"{quantizer.name}: {describe(x, 'normal data', seed)} quantized twice gave different data or scales")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_each_group_quantizes_the_same_whatever_else_is_in_the_call(quantizer, dtype):
    """One scale per row means rows do not affect each other: a token's cached
    keys must not depend on which other tokens were written in the same step."""
    if quantizer.granularity == PER_TENSOR and not quantizer.static_scale:
        not_applicable("per_tensor: one scale covers the whole tensor by design")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes(quantizer):
        if shape[0] < 2:
            continue
        maxima = magnitudes_per_group(shape, quantizer.granularity, gen, -3, 4)
        x = random_input(shape, quantizer.granularity, gen, maxima, dtype)
        whole = quantizer.quantize(x)
        split = 1 + int(torch.randint(0, shape[0] - 1, (1,), generator=gen))
        for rows in (slice(0, split), slice(split, None)):
            part = quantizer.quantize(x[rows])
            scales_agree = (same_bits(whole.scale, part.scale) if quantizer.static_scale  # the one fixed scale
                            else same_bits(whole.scale[rows], part.scale))
            assert same_bits(whole.data[rows], part.data) and scales_agree, (
                f"{quantizer.name}: {describe(x, f'rows {rows.start}:{rows.stop}', seed)} quantized alone differ "
                "from the same rows quantized with the others")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_kv_capable_quantizers_round_trip_through_the_kv_cache_block_layout(quantizer, dtype):
    """KV-capable = `per_token` or static-scale: keys and values written by slot into
    the cache's rows of bytes (data, then one float32 scale per token and KV head)
    come back within the bound, and slots not written stay as they were. A
    static-scale quantizer gets a key and a value scale of its own for the layer
    (`KVCacheSpec.kv_scales`), each slot's being its tensor's."""
    if not kv_capable(quantizer):
        not_applicable(f"{quantizer.granularity}: not KV-capable, checked as a weight/tensor quantizer")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=dtype, quantizer=quantizer)
    if quantizer.static_scale:  # keys and values with scales of their own, large enough for every group
        spec = dataclasses.replace(spec, kv_scales=(quantizer.calibrated_scale(1e4, 1.0),
                                                    quantizer.calibrated_scale(3e4, 1.0)))
    num_blocks, tokens = 3, 9
    cache = torch.zeros((num_blocks, spec.layer_block_bytes()), dtype=spec.tensor_dtype)
    slots = torch.randperm(num_blocks * spec.block_size, generator=gen)[:tokens]
    slots[0] = -1  # a padding token: written nowhere
    shape = (tokens, spec.num_kv_heads, spec.head_size)
    key, value = (random_input(shape, PER_TOKEN, gen, magnitudes_per_group(shape, PER_TOKEN, gen, -3, 4), dtype)
                  for _ in range(2))
    write_quantized_kv_by_slot(key, value, cache, slots, spec)
    back = dequantize_kv_blocks(cache, spec, torch.arange(num_blocks), torch.float64)
    back = back.permute(1, 0, 2, 3, 4).reshape(2, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_size)
    written = slots >= 0
    _, stored_scales = quantized_kv_views(cache, spec)
    stored_scales = stored_scales.permute(1, 0, 2, 3).reshape(2, num_blocks * spec.block_size, spec.num_kv_heads)
    for index, (x, kv_quantizer) in enumerate(zip((key, value), spec.key_value_quantizers)):
        got = back[index, slots[written]]
        reference = x[written].double()
        amax = group_amax(x[written], PER_TOKEN)
        if quantizer.static_scale:  # within its range by construction; judged as its own round trip is
            amax = amax.clamp_min(kv_quantizer.precise_from)
            want = torch.full_like(stored_scales[index, slots[written]], kv_quantizer.scale)
            assert torch.equal(stored_scales[index, slots[written]], want), (
                f"{quantizer.name}: {describe(x, ('keys', 'values')[index], seed)}: stored scales are not the "
                f"layer's {('key', 'value')[index]} scale {kv_quantizer.scale:g} in every written slot")
        allowed = quantizer.error_bound * amax
        assert bool(((got - reference).abs() <= allowed).all()), (
            f"{quantizer.name}: {describe(x, ('keys', 'values')[index], seed)} stored in the KV cache layout came "
            f"back with errors up to {(got - reference).abs().max().item():.3g}, over error_bound × group max")
    untouched = torch.ones(num_blocks * spec.block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert bool((back[:, untouched] == 0).all()), f"{quantizer.name}: slots never written changed"
