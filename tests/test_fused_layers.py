"""The fused model layers compute what the unfused Hugging Face layers compute:
activations, products and residual adds folded into the GEMMs (oneDNN post-ops,
or in-place torch ops for plain `nn.Linear`), q/k/v stacked into one projection,
rotary without copies, and RMSNorm rounding exactly like Hugging Face's."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from kvforge.core import ConfigError
from kvforge.models import ModelConfig, load_model
from kvforge.models.layers import ACTIVATIONS, RMSNorm, rotate
from kvforge.models.llama import LlamaForCausalLM, LlamaMLP
from kvforge.models.packed_linear import (POST_OPS, PackedLinear, linear_act, linear_add, linear_mul,
                                          onednn_unavailable, pack_linears)

KERNELS = ["torch"] + (["onednn"] if onednn_unavailable(torch.float32, torch.device("cpu")) is None else [])


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # as the models run
        yield


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).norm() / ref.norm())


def linear64(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ layer.weight.double().T
    return out + layer.bias.double() if layer.bias is not None else out


def with_kernel(module: nn.Module, kernel: str) -> nn.Module:
    module = copy.deepcopy(module)
    if kernel == "onednn":
        pack_linears(module)
    return module


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_with_residual_matches_float64(kernel, act, bias):
    torch.manual_seed(0)
    mlp = LlamaMLP(ModelConfig(hidden_size=40, intermediate_size=72, hidden_act=act), bias=bias)
    x, residual = torch.randn(9, 40), torch.randn(9, 40)
    gated = ACTIVATIONS[act](linear64(mlp.gate_proj, x)) * linear64(mlp.up_proj, x)
    ref = linear64(mlp.down_proj, gated) + residual.double()
    fused = with_kernel(mlp, kernel)
    assert relative_error(fused(x, residual=residual), ref) <= 1e-5
    assert relative_error(fused(x), ref - residual.double()) <= 1e-5  # no residual: the plain MLP


@pytest.mark.parametrize("kernel", KERNELS)
def test_linear_mul_and_add_apply_after_the_bias(kernel):
    torch.manual_seed(1)
    plain = nn.Linear(24, 16)
    layer = plain if kernel == "torch" else PackedLinear(plain.weight, plain.bias)
    x, other = torch.randn(5, 24), torch.randn(5, 16)
    out = linear64(plain, x)
    assert relative_error(linear_mul(layer, x, other), out * other.double()) <= 1e-5
    assert relative_error(linear_add(layer, x, other), out + other.double()) <= 1e-5
    assert relative_error(linear_add(layer, x, None), out) <= 1e-5


@pytest.mark.skipif("onednn" not in KERNELS, reason="this CPU has no float32 oneDNN")
@pytest.mark.parametrize("act", sorted(POST_OPS))
def test_every_onednn_activation_is_the_named_activation(act):
    torch.manual_seed(2)
    plain = nn.Linear(32, 48)
    x = torch.randn(7, 32) * 3
    out = linear_act(PackedLinear(plain.weight, plain.bias), x, act)
    assert relative_error(out, ACTIVATIONS[act](linear64(plain, x))) <= 1e-5


def test_rotate_matches_rotate_half_on_strided_heads():
    torch.manual_seed(3)
    qkv = torch.randn(6, 5, 16)  # q and k are the first 4 heads, a strided view as in the model
    x = qkv[:, :4]
    angles = torch.rand(6, 1, 8) * 10
    cos, sin = angles.cos(), angles.sin()
    x64, cos64, sin64 = x.double(), torch.cat((cos, cos), -1).double(), torch.cat((sin, sin), -1).double()
    ref = x64 * cos64 + torch.cat((-x64[..., 8:], x64[..., :8]), -1) * sin64
    assert relative_error(rotate(x, cos, sin), ref) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_rounds_exactly_like_hugging_face(dtype):
    torch.manual_seed(4)
    ours = RMSNorm(64, 1e-5).to(dtype)
    theirs = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    theirs.weight.copy_(torch.randn(64))
    ours.weight.copy_(theirs.weight)
    x = (torch.randn(11, 64) * 4).to(dtype)
    assert torch.equal(ours(x), theirs(x))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(5)
    hf = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_()  # zeros would hide a bias that went to the wrong rows
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_qkv_keeps_each_projection_and_its_bias(qwen2_dir, kernel):
    tensors = load_file(qwen2_dir / "model.safetensors")
    model = load_model(qwen2_dir, linear_kernel=kernel)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj is not None
    x = torch.randn(3, 32)
    prefix = "model.layers.0.self_attn."
    ref = torch.cat([x.double() @ tensors[f"{prefix}{p}_proj.weight"].double().T + tensors[f"{prefix}{p}_proj.bias"]
                     for p in "qkv"], dim=-1)
    assert relative_error(attn.qkv_proj(x), ref) <= 1e-5


def test_a_missing_qkv_bias_is_still_named(qwen2_dir, tmp_path):
    tensors = load_file(qwen2_dir / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.k_proj.bias")
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((qwen2_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"no tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load_model(tmp_path)


def test_an_unfused_model_refuses_to_run_and_says_why():
    config = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2)
    attn = LlamaForCausalLM(config).model.layers[0].self_attn
    with pytest.raises(ConfigError, match="finish_loading"):
        attn(torch.randn(2, 16), None, None, None)
