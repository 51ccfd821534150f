"""oneDNN-packed linear layers: exact enough against float64, every linear of a
model packed (the head once, even when tied), and clear refusals."""

from __future__ import annotations

import weakref

import pytest
import torch
import transformers
from torch import nn

from kvforge.core import ConfigError, UnsupportedConfigurationError
from kvforge.models import load_model
from tests.model_driver import save_llama
from kvforge.models.packed_linear import (AUTO_MIN_WEIGHT, PackedLinear, onednn_unavailable, pack_linears,
                                          replace_linears)

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [d for d in TOLERANCE if onednn_unavailable(d, CPU) is None]
pytestmark = pytest.mark.skipif(not DTYPES, reason=str(onednn_unavailable(torch.float32, CPU)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 7, 97])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(dtype, rows, bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    b = torch.randn(96, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=generator).to(dtype)
    out = PackedLinear(weight, b)(x)
    ref = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert out.shape == (rows, 96) and out.dtype == dtype
    if rows:
        assert float((out.double() - ref).norm() / ref.norm()) <= TOLERANCE[dtype]


def test_packed_linear_takes_strided_and_batched_input():
    weight = torch.randn(32, 16)
    layer = PackedLinear(weight, None)
    x = torch.randn(16, 10).T  # not contiguous
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    y = torch.randn(2, 3, 16)
    torch.testing.assert_close(layer(y), y @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pack_linears_replaces_every_linear_and_the_head_once(tmp_path, tied):
    path = save_llama(tmp_path, tied)
    plain = load_model(path, linear_kernel="torch")
    model = load_model(path, linear_kernel="torch")
    embedding = model.model.embed_tokens
    count = pack_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert count == 2 * 5 + 1  # qkv (fused at load), o, gate, up, down per layer, and the head
    assert model.model.embed_tokens is embedding  # a tied head never replaces the embedding
    if not tied:
        assert model.lm_head is model.lm_head_layer  # one packed copy, not two
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5)
    layer = model.model.layers[1].mlp
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), plain.model.layers[1].mlp(x), rtol=1e-5, atol=1e-5)


def test_linear_kernel_choices(tmp_path):
    path = save_llama(tmp_path, tied=False)
    assert isinstance(load_model(path, linear_kernel="torch").model.layers[0].mlp.up_proj, nn.Linear)
    assert isinstance(load_model(path, linear_kernel="onednn").model.layers[0].mlp.up_proj, PackedLinear)
    with pytest.raises(ConfigError, match="unknown linear kernel 'mkl'.*auto, torch, onednn"):
        load_model(path, linear_kernel="mkl")


def test_auto_packs_only_the_weights_large_enough_to_gain(tmp_path, monkeypatch):
    # where the C++ kernel does not pay (a CPU without AVX-512); hidden 512: every
    # layer's weight is at least 512 x 512, the 64-token head is not
    monkeypatch.setattr("kvforge.models.loader.cpp_linear_pays", lambda dtype, device: False)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=640, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=4)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "wide")
    wide = load_model(tmp_path / "wide")
    layer = wide.model.layers[0]
    assert all(isinstance(m, PackedLinear) for m in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj))
    assert isinstance(wide.lm_head, nn.Linear) and getattr(wide, "lm_head_layer", None) is None
    assert 64 * 512 < AUTO_MIN_WEIGHT <= 512 * 512
    small = load_model(save_llama(tmp_path / "small", tied=False))  # 32 x 48 weights
    assert not any(isinstance(m, PackedLinear) for m in small.modules())
    hidden = torch.randn(3, 512)
    torch.testing.assert_close(wide.compute_logits(hidden), hidden @ wide.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_unavailable_onednn_is_refused_with_the_reason(tmp_path):
    path = save_llama(tmp_path, tied=False)
    reason = onednn_unavailable(torch.float16, CPU)
    if reason is None:
        pytest.skip("this CPU runs float16 through oneDNN")
    with pytest.raises(UnsupportedConfigurationError, match="'onednn' is unavailable: .*float16.*'torch' or 'auto'"):
        load_model(path, dtype="float16", linear_kernel="onednn")
    # auto falls back to torch's kernel
    assert isinstance(load_model(path, dtype="float16").model.layers[0].mlp.up_proj, nn.Linear)


def test_onednn_unavailable_off_the_cpu():
    assert "CPU" in onednn_unavailable(torch.float32, torch.device("cuda"))


def test_replace_linears_goes_deepest_first_and_lets_each_replaced_layer_go():
    # the model's own children (a vocabulary-sized head) come last, when the deeper float
    # layers are gone: nothing the walk holds keeps a replaced layer alive
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 3))))
    order = [model[2][1][0], model[2][0], model[0]]
    expected = [id(layer) for layer in order]
    seen, earlier = [], []
    del order

    def replacement(layer):
        assert all(ref() is None for ref in earlier)  # each one replaced before is freed already
        seen.append(id(layer))
        if layer.out_features == 3:
            return None  # this one stays
        earlier.append(weakref.ref(layer))
        return nn.Identity()

    assert replace_linears(model, replacement) == 2
    assert seen == expected
    assert isinstance(model[0], nn.Identity) and isinstance(model[2][0], nn.Identity)
    assert isinstance(model[2][1][0], nn.Linear)
