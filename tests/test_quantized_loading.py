"""Loading with int8 weights: each decoder block is finished and quantized as soon
as its tensors are read (`load_weights(on_block=...)`), so the float model is
never held whole, and the model is the same as one quantized after loading."""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from kvforge.core import QUANTIZER, build_registry
from kvforge.models import load_model
from kvforge.models.loader import checkpoint_files, load_config, load_weights
from kvforge.models.meta_build import on_meta
from kvforge.models.quantized_linear import Int8Linear, quantize_linears
from kvforge.models.registry import model_class

INT8_WEIGHT = build_registry().select(QUANTIZER, "int8_weight").cls


def save(tmp_path: Path, config) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


LLAMA = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
QWEN2 = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
GPT2 = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)


def int8_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{buffer}": tensor for name, module in model.named_modules() if isinstance(module, Int8Linear)
            for buffer, tensor in module.named_buffers(recurse=False)}


@pytest.mark.parametrize("config", [LLAMA, QWEN2, GPT2], ids=["llama", "qwen2-tied", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_quantizing_while_reading_gives_the_model_quantized_after_loading(tmp_path, config, dtype, activations):
    path = save(tmp_path, config)
    quantizer = INT8_WEIGHT()
    ours = load_model(path, dtype=dtype, linear_kernel="torch", weight_quantizer=quantizer,
                      weight_activations=activations)
    after = load_model(path, dtype=dtype, linear_kernel="torch")
    quantize_linears(after, quantizer, activations=activations)
    mine, theirs = int8_buffers(ours), int8_buffers(after)
    assert mine.keys() == theirs.keys() and len(mine) >= 4 * config.num_hidden_layers
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in after.modules()]
    float_params = {n: p for n, p in ours.named_parameters()}
    assert float_params.keys() == dict(after.named_parameters()).keys()  # embeddings, norms, biases
    for name, param in after.named_parameters():
        assert torch.equal(float_params[name], param), name


def test_each_block_is_handed_over_once_right_after_its_last_tensor(tmp_path):
    path = save(tmp_path, LLAMA)
    config = load_config(path)
    with on_meta():
        model = model_class(config.get("architectures"))(config)
    blocks = [block for _, block in model.blocks()]
    assert len(blocks) == LLAMA.num_hidden_layers
    handed = []

    def on_block(block):
        # Every tensor of this block is in (none left on the meta device); the checkpoint stores
        # layer after layer, and no tensor of a later layer has been read yet: at most one block
        # is ever held in float.
        assert not any(p.is_meta for p in block.parameters()) and block not in handed
        later = blocks[blocks.index(block) + 1:]
        assert all(p.is_meta for b in later for p in b.parameters())
        handed.append(block)

    load_weights(model, checkpoint_files(path), torch.float32, torch.device("cpu"),
                 parts=[prefix for prefix, _ in model.blocks()], on_part=lambda name: on_block(model.get_submodule(name)))
    assert handed == blocks


def test_blocks_are_the_decoder_layers(tmp_path):
    for config, layers in ((LLAMA, "model.layers"), (GPT2, "transformer.h")):
        model = load_model(save(tmp_path / layers, config), linear_kernel="torch")
        assert [prefix for prefix, _ in model.blocks()] == [f"{layers}.{i}" for i in range(2 if config is GPT2 else 3)]


PEAK_SCRIPT = """
import sys, torch
from pathlib import Path
from kvforge.core import QUANTIZER, build_registry
from kvforge.models import load_model
from kvforge.models.heap import keep_freed_memory

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

quantizer = build_registry().select(QUANTIZER, "int8_weight").cls()
keep_freed_memory()  # as the engine loads
Path("/proc/self/clear_refs").write_text("5")  # the peak starts from here
before = status("VmRSS")
model = load_model(sys.argv[1], dtype=torch.float32, weight_quantizer=quantizer)
print(status("VmHWM") - before, status("VmRSS") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self/clear_refs (Linux)")
def test_an_int8_model_loads_without_holding_its_float_weights_whole(tmp_path):
    # Twelve blocks of float32 weights, small embeddings: a loader that reads the whole float model
    # before quantizing peaks above the float32 weights; one that quantizes each block as it is
    # read holds the int8 model (a quarter of them), one block in float32 and the quantizer's
    # temporaries at most (and, first time, the kernels' library being loaded): under half of them.
    # Placing the int8 weights on 2 MiB pages before the kernels fuse gate and up, then again
    # after, held two placements at once, and went over this bound.
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    path = save(tmp_path, config)
    float32 = sum(f.stat().st_size for f in checkpoint_files(path))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)
    peak, held = map(int, out.stdout.split())
    sizes = f"peak {peak / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB after, float32 weights {float32 / 2**20:.0f} MiB"
    assert held < 0.4 * float32, sizes
    assert peak < 0.55 * float32, sizes


@pytest.mark.parametrize("lm_head", [True, False])
def test_an_untied_head_is_quantized_as_soon_as_it_is_read(tmp_path, monkeypatch, lm_head):
    import kvforge.models.quantized_linear as quantized_linear

    path = save(tmp_path, LLAMA)  # checkpoint names sorted: lm_head.weight comes first
    shapes, replaced = [], []
    real = quantized_linear.int8_linear

    def spy(layer, *args):
        # the float layers quantized before this one are gone: nothing holds them once replaced
        assert all(ref() is None for ref in replaced), "a replaced float layer is still held"
        shapes.append(tuple(layer.weight.shape))
        replaced.append(weakref.ref(layer))
        return real(layer, *args)

    monkeypatch.setattr(quantized_linear, "int8_linear", spy)
    model = load_model(path, linear_kernel="torch", weight_quantizer=INT8_WEIGHT(), quantize_lm_head=lm_head)
    head = (LLAMA.vocab_size, LLAMA.hidden_size)
    assert len(shapes) > 4 * LLAMA.num_hidden_layers
    if lm_head:
        assert shapes[0] == head and head not in shapes[1:]  # before any block, once
        assert isinstance(model.lm_head, Int8Linear) and model.lm_head_layer is model.lm_head
    else:
        assert head not in shapes and isinstance(model.lm_head, nn.Linear)


@pytest.mark.parametrize("rows_bytes", [1, 3 * 64 * 4, 2**30])  # a row at a time, 3 rows, the whole weight
def test_a_weight_quantized_in_parts_is_the_weight_quantized_whole(monkeypatch, rows_bytes):
    import kvforge.models.quantized_linear as quantized_linear

    monkeypatch.setattr(quantized_linear, "QUANTIZE_ROWS_BYTES", rows_bytes)
    layer = nn.Linear(64, 80)
    with torch.no_grad():
        layer.weight.normal_().mul_(torch.rand(80, 1) * 10)  # rows of different scales
    quantizer = INT8_WEIGHT()
    whole = quantizer.quantize(layer.weight.detach())
    data, scale = quantized_linear._quantized_rows(quantizer, layer.weight.detach())
    assert torch.equal(data, whole.data) and torch.equal(scale.reshape(-1), whole.scale.reshape(-1))
