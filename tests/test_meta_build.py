"""Models built on the meta device skip their initialisers, and so never import
torch._dynamo (with sympy and triton) for a process that compiles nothing."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from kvforge.models.meta_build import on_meta


def imports_after(build: str) -> list[str]:
    """The heavy modules a fresh interpreter has imported after running `build`."""
    code = "\n".join([
        "import sys, torch",
        "from torch import nn",
        "from kvforge.models.meta_build import on_meta",
        "from kvforge.models.base import ModelConfig",
        "from kvforge.models.llama import LlamaForCausalLM",
        build,
        'print(",".join(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))',
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return [m for m in done.stdout.strip().split(",") if m]


SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def test_a_model_built_on_meta_imports_no_compiler():
    assert imports_after(f"with on_meta(): LlamaForCausalLM(ModelConfig({SMALL!r}))") == []


def test_finishing_a_model_left_on_meta_imports_no_compiler():
    # a pipeline stage's layers of other stages stay on meta, and are fused all the same
    build = f"with on_meta(): model = LlamaForCausalLM(ModelConfig({SMALL!r}))\nmodel.finish_loading()"
    assert imports_after(build) == []


def test_torch_device_meta_alone_would_import_it():
    # what on_meta saves: nn.Embedding's normal_ on a meta tensor runs a decomposition that imports torch._dynamo
    assert "torch._dynamo" in imports_after("with torch.device('meta'): nn.Embedding(8, 4)")


def test_on_meta_builds_meta_tensors_of_the_declared_shapes():
    with on_meta():
        embedding, linear = nn.Embedding(10, 6, padding_idx=0), nn.Linear(6, 3)
        loose = torch.empty(2, 5)
    assert embedding.weight.is_meta and embedding.weight.shape == (10, 6)
    assert linear.weight.is_meta and linear.weight.shape == (3, 6) and linear.bias.shape == (3,)
    assert loose.is_meta


def test_tensors_on_a_real_device_are_still_initialised_inside():
    with on_meta():
        on_cpu = torch.zeros(64, device="cpu")
        nn.init.normal_(on_cpu)
        direct = torch.zeros(64, device="cpu").normal_()
        uniform = nn.init.uniform_(torch.zeros(64, device="cpu"), 1.0, 2.0)
    assert on_cpu.std() > 0.5 and direct.std() > 0.5
    assert bool((uniform >= 1.0).all()) and uniform.min() < uniform.max()


def test_outside_the_block_initialisers_work_as_before():
    with on_meta():
        pass
    assert nn.Embedding(32, 8).weight.std() > 0.5
    assert torch.empty(4).device.type == "cpu"
