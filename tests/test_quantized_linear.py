"""int8 linear layers: the same math as float64 on the quantized operands, weight-only
(the default: float activations) and W8A8 (`activations="int8"`), the fused post-ops
kept, every linear but the head quantized at load, ~4x fewer bytes, clear refusals of
quantizers the layer cannot run, and the engine end to end with either choice. The
C++ kernel itself is checked in test_int8_weight_linear.py."""

from __future__ import annotations


import pytest
import torch
import transformers
from torch import nn

from kvforge.core import (PER_CHANNEL, PER_TOKEN, QUANTIZER, QuantizedTensor, Quantizer, UnsupportedConfigurationError,
                          build_registry, hookimpl)
from kvforge.models import load_model
from tests.model_driver import save_llama
from kvforge.models.packed_linear import PackedLinear, linear_act, linear_add, linear_mul
from kvforge.models.quantized_linear import (Int8GateUp, Int8Linear, int8_linear_unsupported, quantize_linears,
                                             quantize_rows)

INT8_WEIGHT = build_registry().select(QUANTIZER, "int8_weight").cls


def quantized_layer(out_features=48, in_features=40, bias=True, seed=0, activations="int8"):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[3] *= 20  # channels of very different ranges: each needs its own scale
    b = torch.randn(out_features, generator=generator) if bias else None
    q = INT8_WEIGHT().quantize(weight)
    return Int8Linear(q.data, q.scale, b, activations), weight, b


def reference(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 `(q_x * s_x) @ (w_int8 * s_w)^T + b`: the layer's math with exact arithmetic,
    on activations quantized row by row as the spec says (symmetric absmax, round to nearest)."""
    x64 = x.double()
    s_x = (x64.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q_x = (x64 / s_x).round()
    w = layer.int8_rows().double() * layer.weight_scale.double()[:, None]
    out = (q_x * s_x) @ w.T
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_int8_linear_is_the_quantized_math_in_float64(rows, bias):
    layer, _, _ = quantized_layer(bias=bias, seed=rows)
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(100 + rows))
    out = layer(x)
    ref = reference(layer, x)
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    # int32 accumulation is exact: only the float32 scaling rounds (a few ulps); a
    # scale on the wrong axis, a missing bias or a transposed weight is off by far more.
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-6


def test_w8a8_int8_linear_stays_within_the_quantization_bound_of_the_float_weight():
    """Against the original float weight, each output is off by at most the two roundings:
    |x| s_w/2 summed over the input (weights) plus |w_dq| s_x/2 summed (activations)."""
    layer, weight, b = quantized_layer()
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ weight.double().T + b.double()
    s_x = x.double().abs().amax(-1, keepdim=True) / 127
    s_w = layer.weight_scale.double()
    bound = (x.double().abs().sum(-1, keepdim=True) * s_w / 2 * (1 + 1e-6)
             + s_x / 2 * layer.dequantized_weight(torch.float64).abs().sum(-1)) + 1e-9
    error = (layer(x).double() - exact).abs()
    assert bool((error <= bound).all())
    assert float(error.max()) > 0  # it is quantized, not the float weight in disguise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_off_cpu_path_is_weight_only_dequantized_math(dtype):
    """The path other devices take (`_widened_gemm`, run here on CPU): `x @ (w_int8 * s_w)^T + b`
    with x unquantized, rounding only in `dtype`."""
    layer, _, _ = quantized_layer()
    layer.bias = layer.bias.to(dtype)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    out = layer._widened_gemm(x.to(dtype))
    ref = x.to(dtype).double() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    assert out.dtype == dtype
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= (1e-6 if dtype == torch.float32 else 2e-2)


def test_the_float64_check_catches_a_broken_kernel():
    """A kernel applying each weight scale to the wrong axis (per input, not per output
    channel) fails the check above: the check is not one any output passes."""
    layer, _, _ = quantized_layer(out_features=40, in_features=40)

    class ScaleOnWrongAxis(Int8Linear):
        def forward(self, x):
            q, s = quantize_rows(x)
            return (q.float() * s) @ (self.weight_int8.float() * self.weight_scale[None, :]).T + self.bias

    broken = ScaleOnWrongAxis(layer.weight_int8, layer.weight_scale, layer.bias, "int8")
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    ref = reference(layer, x)
    assert float((broken(x).double() - ref).abs().max() / ref.abs().max()) > 1e-2
    assert float((layer(x).double() - ref).abs().max() / ref.abs().max()) <= 1e-6


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_weight_only_int8_linear_is_the_dequantized_math_with_float_activations(rows, dtype):
    """The default: `x @ (w_int8 * s_w)^T + b` with x as it is (not rounded to int8),
    accumulated in float32; float16 rows go through float32 and come back float16."""
    layer, _, _ = quantized_layer(seed=rows, activations="none")
    assert layer.activations == "none"
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(200 + rows)).to(dtype)
    out = layer(x)
    ref = x.double() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    assert out.dtype == dtype and out.shape == (rows, 48)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= (1e-6 if dtype == torch.float32 else 4e-3)
    w8a8 = Int8Linear(layer.int8_rows(), layer.weight_scale, layer.bias, "int8")
    assert float((w8a8(x).double() - ref).abs().max() / ref.abs().max()) > 1e-4  # W8A8 rounds x too: not this


def test_activations_must_be_a_valid_choice_and_int8_only_on_cpu():
    layer, _, _ = quantized_layer()
    with pytest.raises(ValueError, match="'none', 'int8'.*'int4'"):
        Int8Linear(layer.weight_int8, layer.weight_scale, None, "int4")
    with pytest.raises(UnsupportedConfigurationError, match="activations 'int4' is not a choice.*'none'.*'int8'"):
        quantize_linears(nn.Sequential(nn.Linear(4, 4)), INT8_WEIGHT(), activations="int4")
    on_meta = torch.empty(4, 4, dtype=torch.int8, device="meta")
    with pytest.raises(UnsupportedConfigurationError, match="CPU only.*meta.*'none'"):
        Int8Linear(on_meta, torch.ones(4, device="meta"), None, "int8")


def test_a_failed_kernel_build_is_a_clear_error_that_names_the_w8a8_choice(monkeypatch):
    """Weight-only on CPU needs the C++ library; when it cannot build, the error says
    so and what runs without it, instead of falling back silently."""
    from kvforge.kernels import build

    def fails():
        raise build.CppBuildError("no C++ compiler")

    monkeypatch.setattr(build, "load", fails)
    layer, _, _ = quantized_layer()
    with pytest.raises(UnsupportedConfigurationError, match="no C\\+\\+ compiler.*activations = 'int8'"):
        Int8Linear(layer.weight_int8, layer.weight_scale, None, "none")
    Int8Linear(layer.weight_int8, layer.weight_scale, None, "int8")  # W8A8 compiles nothing


def test_quantize_rows_rounds_each_row_to_nearest_with_its_own_scale():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-3, 1, 10, 1e3, 0, 1])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (6, 1)
    assert int(q[4].abs().max()) == 0 and float(scale[4]) > 0  # a zero row: zeros, positive scale
    assert bool((q[[0, 1, 2, 3, 5]].abs().amax(-1) == 127).all())  # each row's largest maps to 127
    assert bool(((q.float() * scale - x).abs() <= scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_int8_linear_takes_batched_and_strided_input_and_zero_rows(activations):
    layer, _, _ = quantized_layer(activations=activations)
    x = torch.randn(2, 3, 40)
    torch.testing.assert_close(layer(x), layer(x.reshape(6, 40)).view(2, 3, 48))
    strided = torch.randn(40, 5).T
    torch.testing.assert_close(layer(strided), layer(strided.contiguous()))
    assert layer(torch.empty(0, 40)).shape == (0, 48)


@pytest.mark.parametrize("activations", ["none", "int8"])
@pytest.mark.parametrize("act", ["silu", "gelu_new"])
def test_fused_post_ops_keep_their_meaning(act, activations):
    """linear_act / linear_mul / linear_add on an Int8Linear equal the op applied to its output."""
    layer, _, _ = quantized_layer(activations=activations)
    x, other = torch.randn(5, 40), torch.randn(5, 48)
    y = layer(x)
    from kvforge.models.layers import activation

    torch.testing.assert_close(linear_act(layer, x, act), activation(act)(y))
    torch.testing.assert_close(linear_mul(layer, x, other), y * other)
    torch.testing.assert_close(linear_add(layer, x, other), y + other)
    torch.testing.assert_close(linear_add(layer, x, None), y)


@pytest.mark.parametrize("activations", ["none", "int8"])
@pytest.mark.parametrize("seed", range(5))
def test_bfloat16_input_gives_bfloat16_output_close_to_float32(activations, seed):
    """bfloat16 rows give the float32 result on the same (bfloat16) values, rounded
    once to bfloat16 (half an ulp, at most 2^-8 relative) up to float32 summation order.
    Against the unrounded float32 input W8A8 can differ by far more: rounding x to
    bfloat16 moves some inputs across a quantization step (measured up to 5% of
    the largest output over 3,000 random inputs), which is why the comparison is
    on the same values."""
    layer, _, _ = quantized_layer(bias=False, activations=activations)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(seed)).bfloat16()
    out = layer(x)
    ref = layer(x.float()).double()
    assert out.dtype == torch.bfloat16
    assert bool(((out.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all())


# Loading

def linear_bytes(model: nn.Module) -> int:
    """Bytes held by the decoder's linear layers (float, packed or int8), not the head or embeddings."""
    total = 0
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, Int8Linear):
                total += sum(t.numel() * t.element_size() for t in module.buffers())
            elif isinstance(module, nn.Linear):
                total += sum(t.numel() * t.element_size() for t in module.parameters())
            elif isinstance(module, PackedLinear):
                total += module.packed.numel() * module.packed.element_size()
    return total


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_quantizes_every_linear_and_an_untied_head(tmp_path, tied):
    path = save_llama(tmp_path, tied)
    model = load_model(path, weight_quantizer=INT8_WEIGHT(), linear_kernel="onednn")
    layer = model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                   layer.mlp.down_proj):
        assert isinstance(module, Int8Linear)
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 5 + (not tied)
    assert isinstance(model.model.embed_tokens, nn.Embedding)  # lookups stay float
    assert not any(isinstance(m, nn.Linear) for m in model.modules())  # no float linear weight is kept
    if tied:  # the head is the embedding: it stays float and `linear_kernel` packs a copy
        assert isinstance(model.lm_head_layer, PackedLinear)
    else:
        assert model.lm_head_layer is model.lm_head and isinstance(model.lm_head, Int8Linear)
        assert model.lm_head_weight() is None
    assert model.dtype == torch.float32
    hidden = torch.randn(3, 32)
    head = model.lm_head_layer
    expected = (hidden @ head.dequantized_weight().T if isinstance(head, Int8Linear)
                else hidden @ model.model.embed_tokens.weight.T)
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=2e-2 * float(expected.abs().max()),
                               rtol=0)


def test_the_head_can_stay_in_float(tmp_path):
    model = load_model(save_llama(tmp_path, tied=False), weight_quantizer=INT8_WEIGHT(), quantize_lm_head=False,
                       linear_kernel="torch")
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head_weight() is model.lm_head.weight
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 5


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantized_linears_hold_a_quarter_of_the_float32_bytes(tmp_path, tied):
    path = save_llama(tmp_path, tied)
    plain = load_model(path, linear_kernel="torch")
    quantized = load_model(path, linear_kernel="torch", weight_quantizer=INT8_WEIGHT())
    ratio = linear_bytes(plain) / linear_bytes(quantized)
    # int8 data is 1/4 of float32; the per-channel float32 scales add 4 bytes per output row
    assert 3.5 < ratio <= 4.0
    head = 0 if tied else 64 * 32 * 4 - (64 * 32 + 64 * 4)  # float32 head minus int8 head and its scales
    saved = plain.weight_bytes() - quantized.weight_bytes()
    assert saved == linear_bytes(plain) - linear_bytes(quantized) + head  # nothing else changed, nothing kept twice


def test_gpt2_conv1d_layers_are_quantized_with_their_transpose(tmp_path):
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    plain = load_model(tmp_path, linear_kernel="torch")
    model = load_model(tmp_path, linear_kernel="torch", weight_quantizer=INT8_WEIGHT())
    mlp = model.transformer.h[0].mlp
    assert isinstance(mlp.c_fc, Int8Linear) and mlp.c_fc.out_features == 128
    torch.testing.assert_close(mlp.c_fc.dequantized_weight(), plain.transformer.h[0].mlp.c_fc.weight.T,
                               atol=float(mlp.c_fc.weight_scale.max()) / 2 + 1e-7, rtol=0)


# Quantizers chosen by name

class ThirdPartyInt8PerChannel(Quantizer):
    """Written against `kvforge.core` alone, as a plugin package would: absmax int8 per row."""

    name = "acme_int8_channel"
    storage_dtype = torch.int8
    granularity = PER_CHANNEL
    error_bound = 1.0 / 252

    def scales(self, x):
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
        return torch.where(amax > 0, amax / 127, torch.ones_like(amax))

    def quantize(self, x):
        self.check_finite(x)
        scale = self.scales(x)
        return QuantizedTensor(torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale, x.dtype)

    def dequantize(self, q, dtype=None):
        return (q.data.float() * q.scale).to(dtype or q.original_dtype)


class PerTokenInt8(ThirdPartyInt8PerChannel):
    name = "acme_int8_token"
    granularity = PER_TOKEN


def test_a_third_party_per_channel_int8_quantizer_works_the_same(tmp_path):
    path = save_llama(tmp_path, tied=False)
    ours = load_model(path, weight_quantizer=INT8_WEIGHT())
    theirs = load_model(path, weight_quantizer=ThirdPartyInt8PerChannel())
    hidden = torch.randn(3, 32)
    x = torch.randn(2, 32)
    torch.testing.assert_close(theirs.model.layers[0].mlp(x), ours.model.layers[0].mlp(x))
    torch.testing.assert_close(theirs.compute_logits(hidden), ours.compute_logits(hidden))


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_a_quantizer_the_int8_linear_cannot_run_is_refused(tmp_path, name):
    cls = build_registry().select(QUANTIZER, name).cls
    reason = int8_linear_unsupported(cls)
    assert reason is not None and "per_channel" in reason and name in reason
    with pytest.raises(UnsupportedConfigurationError, match=f"{name}.*per_channel.*int8_weight"):
        load_model(save_llama(tmp_path, tied=False), weight_quantizer=cls())
    assert int8_linear_unsupported(INT8_WEIGHT) is None and int8_linear_unsupported(ThirdPartyInt8PerChannel) is None
    assert "granularity 'per_token'" in int8_linear_unsupported(PerTokenInt8)


def test_a_quantizer_returning_the_wrong_scale_shape_is_refused(tmp_path):
    class OneScale(ThirdPartyInt8PerChannel):
        name = "acme_one_scale"

        def scales(self, x):
            return super().scales(x).amax().reshape(1, 1)

    with pytest.raises(UnsupportedConfigurationError, match="acme_one_scale.*one scale per output channel"):
        quantize_linears(load_model(save_llama(tmp_path, tied=False), linear_kernel="torch"), OneScale())


# The engine

def engine_config(path, weights, **quantization):
    from kvforge.core import load_config

    return load_config(model=str(path), device="cpu", dtype="float32", seed=0,
                       quantization={"weights": weights, **quantization},
                       cache={"num_blocks": 64, "block_size": 16}).config


def test_config_refuses_unknown_activations_with_the_choices(tmp_path):
    from kvforge.core import ConfigError

    with pytest.raises(ConfigError, match=r"activations.*'none'.*'int8'"):
        engine_config(tmp_path, "int8_weight", activations="fp8")


@pytest.mark.parametrize("activations", [None, "none", "int8"])
def test_engine_runs_end_to_end_with_int8_weights(tmp_path, activations):
    from kvforge import LLMEngine, SamplingParams

    path = save_llama(tmp_path, tied=False)
    extra = {} if activations is None else {"activations": activations}
    engine = LLMEngine(engine_config(path, "int8_weight", **extra))
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    # 4 per layer and the head: gate and up as one Int8GateUp (its `both`), on the C++ kernels here
    assert len(layers) == 9
    assert sum(isinstance(m, Int8GateUp) for m in engine.model.modules()) == 2
    assert {m.activations for m in layers} == {activations or "none"}  # weight-only unless asked
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=[1 + i, 5, 9, 13], params=params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert sorted(outputs) == ["r0", "r1", "r2"]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs.values())


@pytest.mark.parametrize("name, message", [
    ("int8", r"'int8'.*per_channel.*qualify: int8_weight.*kv_cache_dtype"),
    ("auto", r"'auto' is not a choice.*int8_weight"),
    ("int4_awq", r"int4_awq"),
])
def test_engine_refuses_a_weight_quantizer_it_cannot_run(tmp_path, name, message):
    from kvforge import LLMEngine
    from kvforge.core import KvforgeError

    with pytest.raises(KvforgeError, match=message):
        LLMEngine(engine_config(save_llama(tmp_path, tied=False), name))


class _AcmePlugin:
    @hookimpl
    def kvforge_implementations(self):
        return [ThirdPartyInt8PerChannel, PerTokenInt8]


def registry_with_acme():
    registry = build_registry()
    registry.register_plugin(_AcmePlugin(), "acme")
    return registry


def test_engine_takes_a_third_party_weight_quantizer_by_name(tmp_path):
    from kvforge import LLMEngine

    path = save_llama(tmp_path, tied=False)
    theirs = LLMEngine(engine_config(path, "acme_int8_channel"), registry=registry_with_acme()).model
    ours = LLMEngine(engine_config(path, "int8_weight")).model
    pairs = [(a, b) for a, b in zip(theirs.modules(), ours.modules()) if isinstance(a, Int8Linear)]
    assert len(pairs) == 9  # 4 per layer (gate and up fused) and the head
    for a, b in pairs:
        assert torch.equal(a.weight_int8, b.weight_int8) and torch.equal(a.weight_scale, b.weight_scale)


def test_engine_refusal_lists_every_qualifying_quantizer(tmp_path):
    from kvforge import LLMEngine

    with pytest.raises(UnsupportedConfigurationError,
                       match=r"'acme_int8_token'.*granularity 'per_token'.*qualify: acme_int8_channel, int8_weight"):
        LLMEngine(engine_config(save_llama(tmp_path, tied=False), "acme_int8_token"), registry=registry_with_acme())
