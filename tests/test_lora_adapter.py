"""Reading PEFT LoRA adapters: what is refused (each message naming the field and
value, tensor and shapes, or file), and what is read (ranks, scales, per-layer
patterns, fingerprints)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.models import LoRAAdapterError, enable_lora, load_model, load_peft_adapter

sys.path.insert(0, str(Path(__file__).parent))  # the test-local helpers sit beside this file
from lora_fixtures import save_adapter, save_base

pytest.importorskip("peft")

MAX_RANK = 8
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(base dir, a valid adapter dir, the kvforge model)."""
    root = tmp_path_factory.mktemp("llama")
    base = save_base("llama", root / "base")
    adapter = save_adapter(base, root / "adapter", r=4, alpha=8, seed=1)
    return base, adapter, load_model(base, linear_kernel="torch")


def edited(adapter: Path, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of `adapter` with `config` merged into its adapter_config.json and its
    tensors passed through `tensors` (a function of the dict)."""
    copy = tmp_path / "edited"
    shutil.copytree(adapter, copy)
    if config is not None:
        path = copy / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        path = copy / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path)
    return copy


def refused(path: Path, model, *, max_rank: int = MAX_RANK) -> str:
    with pytest.raises(LoRAAdapterError) as info:
        load_peft_adapter(path, model, max_rank=max_rank)
    return str(info.value)


@pytest.mark.parametrize("field, value, words", [
    ("use_dora", True, ["use_dora", "true", "DoRA"]),
    ("bias", "all", ["bias", '"all"', "none"]),
    ("peft_type", "IA3", ["peft_type", '"IA3"', "LORA"]),
    ("modules_to_save", ["lm_head"], ["modules_to_save", "lm_head"]),
    ("lora_bias", True, ["lora_bias"]),
    ("r", 0, ["r = 0", "positive"]),
])
def test_refuses_unsupported_settings_naming_field_and_value(llama, tmp_path, field, value, words):
    _, adapter, model = llama
    message = refused(edited(adapter, tmp_path, {field: value}), model)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head", "model.embed_tokens"])
def test_refuses_embedding_and_head_targets(llama, tmp_path, target):
    _, adapter, model = llama
    message = refused(edited(adapter, tmp_path, {"target_modules": ["q_proj", target]}), model)
    assert repr(target) in message and "target_modules" in message


def test_refuses_a_regex_that_targets_the_embedding(llama, tmp_path):
    _, adapter, model = llama
    message = refused(edited(adapter, tmp_path, {"target_modules": r".*(q_proj|embed_tokens)"}), model)
    assert "embed_tokens" in message and "target_modules" in message


def test_refuses_embedding_weights_in_the_file(llama, tmp_path):
    _, adapter, model = llama

    def add_embedding(tensors):
        tensors[f"{PREFIX}model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 128)
        return tensors

    assert "lora_embedding_A" in refused(edited(adapter, tmp_path, tensors=add_embedding), model)


def test_refuses_a_target_module_the_model_does_not_have(llama, tmp_path):
    _, adapter, model = llama
    message = refused(edited(adapter, tmp_path, {"target_modules": ["q_proj", "w_pack"]}), model)
    assert "'w_pack'" in message and "q_proj" in message and "down_proj" in message  # the choices


def test_refuses_a_rank_above_max_rank(llama, tmp_path):
    _, adapter, model = llama
    message = refused(adapter, model, max_rank=2)
    assert "rank 4" in message and "max_rank 2" in message and "max_lora_rank" in message


def test_refuses_a_rank_pattern_above_max_rank_naming_rank_pattern(llama, tmp_path):
    base, _, model = llama
    adapter = save_adapter(base, tmp_path / "a", r=2, rank_pattern={"v_proj": 6})
    message = refused(adapter, model, max_rank=4)
    assert "rank_pattern" in message and "rank 6" in message and "v_proj" in message


def test_refuses_weights_for_another_base_naming_tensor_and_shapes(llama, tmp_path):
    _, adapter, model = llama
    key = f"{PREFIX}model.layers.1.mlp.down_proj.lora_A.weight"

    def widen(tensors):
        tensors[key] = torch.zeros(4, 96)  # the base's intermediate size is 128
        return tensors

    message = refused(edited(adapter, tmp_path, tensors=widen), model)
    assert key in message and "(4, 96)" in message and "(4, 128)" in message


def test_refuses_a_lora_a_without_its_lora_b(llama, tmp_path):
    _, adapter, model = llama
    key = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"
    message = refused(edited(adapter, tmp_path, tensors=lambda t: {k: v for k, v in t.items() if k != key}), model)
    assert key in message


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_refuses_a_directory_without_its_files_naming_the_file(llama, tmp_path, missing):
    _, adapter, model = llama
    copy = edited(adapter, tmp_path)
    (copy / missing).unlink()
    message = refused(copy, model)
    assert missing in message and str(copy) in message


def test_refuses_pickled_weights(llama, tmp_path):
    _, adapter, model = llama
    copy = edited(adapter, tmp_path)
    (copy / "adapter_model.safetensors").rename(copy / "adapter_model.bin")
    assert "never pickle" in refused(copy, model)


def test_refuses_an_adapter_of_another_architecture(llama, tmp_path):
    _, _, model = llama
    gpt2 = save_base("gpt2", tmp_path / "gpt2")
    message = refused(save_adapter(gpt2, tmp_path / "gpt2_adapter", target_modules=["c_fc"]), model)
    assert "'c_fc'" in message and "q_proj" in message


def test_reads_rank_scale_targets_and_orientation(llama):
    _, adapter, model = llama
    read = load_peft_adapter(adapter, model, max_rank=MAX_RANK)
    assert (read.rank, read.alpha, read.scale) == (4, 8.0, 2.0)
    assert set(read.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    a, b = read.weights["model.layers.1.self_attn.k_proj"]
    assert a.shape == (4, 64) and b.shape == (32, 4) and a.dtype == b.dtype == torch.float32  # B [out, r]
    stored = load_file(Path(adapter) / "adapter_model.safetensors")
    assert torch.equal(b, stored[f"{PREFIX}model.layers.1.self_attn.k_proj.lora_B.weight"])


def test_gpt2_conv1d_adapters_map_to_checkpoint_names(tmp_path):
    base = save_base("gpt2", tmp_path / "gpt2")
    model = load_model(base, linear_kernel="torch")
    read = load_peft_adapter(save_adapter(base, tmp_path / "a", r=2), model, max_rank=MAX_RANK)
    a, b = read.weights["transformer.h.1.mlp.c_fc"]
    assert a.shape == (2, 64) and b.shape == (256, 2)
    assert "transformer.h.0.attn.c_attn" in read.weights and "transformer.h.0.mlp.c_proj" in read.weights


def test_rslora_scale(llama, tmp_path):
    base, _, model = llama
    read = load_peft_adapter(save_adapter(base, tmp_path / "a", r=4, alpha=8, use_rslora=True), model,
                             max_rank=MAX_RANK)
    assert read.scale == 8 / math.sqrt(4)


def test_patterns_and_layers_to_transform(llama, tmp_path):
    """rank_pattern and alpha_pattern give a layer its own rank and scale (folded into
    its B relative to the adapter's scale); layers_to_transform keeps other layers out."""
    base, _, model = llama
    adapter = save_adapter(base, tmp_path / "a", r=2, alpha=4, target_modules=["q_proj", "v_proj"],
                           rank_pattern={"v_proj": 6}, alpha_pattern={"q_proj": 16}, layers_to_transform=[1])
    read = load_peft_adapter(adapter, model, max_rank=MAX_RANK)
    assert sorted(read.weights) == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert read.rank == 6 and read.scale == 2.0
    stored = load_file(adapter / "adapter_model.safetensors")
    q_b = stored[f"{PREFIX}model.layers.1.self_attn.q_proj.lora_B.weight"]
    v_b = stored[f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert torch.allclose(read.weights["model.layers.1.self_attn.q_proj"][1], q_b * (16 / 2) / 2.0)
    assert torch.allclose(read.weights["model.layers.1.self_attn.v_proj"][1], v_b * (4 / 6) / 2.0)


def test_fingerprint_follows_the_bytes(llama, tmp_path):
    _, adapter, model = llama
    first = load_peft_adapter(adapter, model, max_rank=MAX_RANK).fingerprint
    assert load_peft_adapter(adapter, model, max_rank=MAX_RANK).fingerprint == first
    key = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"

    def nudge(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] += 1e-3
        return tensors

    assert load_peft_adapter(edited(adapter, tmp_path, tensors=nudge), model, max_rank=MAX_RANK).fingerprint != first


def test_reads_against_a_lora_enabled_and_fused_model(llama, tmp_path):
    """The same adapter reads the same against the model once LoRA wraps its layers."""
    base, adapter, plain = llama
    model = load_model(base, linear_kernel="torch")
    enable_lora(model, max_loras=1, max_rank=MAX_RANK)
    assert load_peft_adapter(adapter, model, max_rank=MAX_RANK).fingerprint == \
        load_peft_adapter(adapter, plain, max_rank=MAX_RANK).fingerprint
