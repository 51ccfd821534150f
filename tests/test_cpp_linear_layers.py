"""The C++ linear layers in a model: `use_cpp_linears` replaces every linear
(the head once, float32 logits; gate and up fused into one SiLU GEMM), each
replaced layer computes what the torch layer did within bfloat16's rounding, or
float32's for a float32 model, `linear_kernel` picks them as documented, and a
float16 model is refused with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from kvforge.core import UnsupportedConfigurationError
from kvforge.models import load_model
from kvforge.models.cpp_linear import (CppGateUp, CppLinear, cpp_linear_pays, cpp_linear_unavailable, kernel_path,
                                       use_cpp_linears)
from tests.model_driver import save_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpp_linear_unavailable(torch.bfloat16, CPU) is not None,
                                reason=str(cpp_linear_unavailable(torch.bfloat16, CPU)))


def close_in_bf16(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within two bfloat16 roundings of the larger values (torch rounds after each op)."""
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-6, atol=2**-7 * scale)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_use_cpp_linears_replaces_every_linear_and_fuses_gate_and_up(tmp_path, tied):
    path = save_llama(tmp_path, tied)
    plain = load_model(path, dtype=torch.bfloat16, linear_kernel="torch")
    model = load_model(path, dtype=torch.bfloat16, linear_kernel="torch")
    embedding = model.model.embed_tokens
    count = use_cpp_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert count == 2 * 5 + 1  # qkv (fused at load), o, gate, up, down per layer, and the head
    assert model.model.embed_tokens is embedding  # a tied head never replaces the embedding
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate_up_proj, CppGateUp) and not hasattr(mlp, "gate_proj")
    if not tied:
        assert model.lm_head is model.lm_head_layer  # one packed copy, not two
    hidden = torch.randn(5, 32).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    close_in_bf16(logits, plain.compute_logits(hidden))
    x = torch.randn(3, 32).bfloat16()
    close_in_bf16(mlp(x), plain.model.layers[1].mlp(x))
    close_in_bf16(mlp(x, residual=x), plain.model.layers[1].mlp(x, residual=x))


def test_gate_and_up_with_biases_and_a_3d_input():
    gate, up = nn.Linear(40, 24).bfloat16(), nn.Linear(40, 24).bfloat16()
    fused = CppGateUp(gate, up)
    x = torch.randn(2, 3, 40).bfloat16()
    ref = torch.nn.functional.silu(gate(x).float()) * up(x).float()
    close_in_bf16(fused(x), ref)
    layer = CppLinear(gate.weight, gate.bias)
    close_in_bf16(layer(x), gate(x))
    close_in_bf16(layer.binary(x, x[..., :24], "add"), gate(x) + x[..., :24])


def test_linear_kernel_choices(tmp_path):
    path = save_llama(tmp_path, tied=False)
    cpp = load_model(path, dtype=torch.bfloat16, linear_kernel="cpp")
    assert isinstance(cpp.model.layers[0].mlp.gate_up_proj, CppGateUp)
    assert cpp.model.norm.kernel == "cpp" and cpp.rotary.kernel == "cpp"
    auto = load_model(path, dtype=torch.bfloat16)
    picked = isinstance(auto.model.layers[0].self_attn.o_proj, CppLinear)
    assert picked == cpp_linear_pays(torch.bfloat16, CPU) == (kernel_path() in ("avx512_bf16", "avx2"))
    torch_model = load_model(path, dtype=torch.bfloat16, linear_kernel="torch")
    assert torch_model.model.norm.kernel == "torch" and torch_model.rotary.kernel == "torch"
    float32 = load_model(path, dtype=torch.float32)  # auto: C++ where it pays, C++ norms and rotary
    picked = isinstance(float32.model.layers[0].mlp.gate_up_proj, CppGateUp)
    assert picked == cpp_linear_pays(torch.float32, CPU) == (kernel_path() != "baseline")
    assert float32.model.norm.kernel == "cpp"


def test_float32_layers_match_float64(tmp_path):
    gate, up = nn.Linear(40, 24), nn.Linear(40, 24)
    fused, layer = CppGateUp(gate, up), CppLinear(gate.weight, gate.bias)
    assert fused.packed.dtype == layer.packed.dtype == torch.float32
    x = torch.randn(2, 3, 40)
    g64, u64, x64 = gate.double(), up.double(), x.double()
    torch.testing.assert_close(fused(x).double(), torch.nn.functional.silu(g64(x64)) * u64(x64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.binary(x, x[..., :24], "add").double(), g64(x64) + x64[..., :24], rtol=1e-5,
                               atol=1e-5)
    path = save_llama(tmp_path, tied=True)
    plain = load_model(path, dtype=torch.float32, linear_kernel="torch")
    model = load_model(path, dtype=torch.float32, linear_kernel="cpp")
    assert isinstance(model.lm_head_layer, CppLinear) and model.lm_head_layer.packed.dtype == torch.float32
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def test_a_float16_model_is_refused_with_the_reason(tmp_path):
    path = save_llama(tmp_path, tied=False)
    with pytest.raises(UnsupportedConfigurationError,
                       match="'cpp' is unavailable: .*bfloat16 and float32.*float16.*'torch'"):
        load_model(path, dtype=torch.float16, linear_kernel="cpp")


def test_qwen2_biases_and_gpt2_conv1d_become_cpp_linears(tmp_path):
    qwen = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(qwen).save_pretrained(tmp_path / "qwen")
    model = load_model(tmp_path / "qwen", dtype=torch.bfloat16, linear_kernel="cpp")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, CppLinear) and qkv.bias is not None
    gpt2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    model = load_model(tmp_path / "gpt2", dtype=torch.bfloat16, linear_kernel="cpp")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, CppLinear) for m in model.modules()) >= 4


PEAK_SCRIPT = """
import sys, torch
from pathlib import Path
from kvforge.models import load_model
from kvforge.models.heap import keep_freed_memory

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

keep_freed_memory()  # as the engine loads: freed blocks below 32 MiB stay in the heap unless given back
Path("/proc/self/clear_refs").write_text("5")  # the peak starts from here
before = status("VmRSS")
model = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]), linear_kernel="cpp")
print(status("VmHWM") - before, status("VmRSS") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self/clear_refs (Linux)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packing_never_holds_the_model_twice(tmp_path, dtype):
    # Each float weight is freed (and given back to the OS) as it is packed, and each packed
    # weight as it moves onto the 2 MiB pages: the loading peak stays under twice the model's
    # weights (float weights, packed copies and the copies on 2 MiB pages held at once made it
    # three times), and what loading freed does not stay in the process.
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    weights = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    weights *= torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), dtype], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)
    peak, held = map(int, out.stdout.split())
    sizes = f"peak {peak / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB after, weights {weights / 2**20:.0f} MiB"
    assert 0.9 * weights < held < 1.5 * weights, sizes
    assert peak < 2 * weights, sizes
