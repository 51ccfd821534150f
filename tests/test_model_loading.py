"""Loading checkpoints: layouts, dtypes, ties, strict errors, architecture plugins, tokenizers."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvforge.core import AttentionBackend
from kvforge.core.errors import ConfigError, UnsupportedConfigurationError
from kvforge.models import architectures, attention_specs, load_model, load_tokenizer, register_architecture
from kvforge.models import registry
from kvforge.models.llama import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))  # the test-local driver sits beside this file
from model_driver import PagedDriver, cpu_backends

BACKEND = cpu_backends()[0]
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    return save(hf, tmp_path_factory.mktemp("llama")), hf


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    return PagedDriver(model, 16, 1, len(ids)).step([ids])[0]


def edit_weights(src: Path, dst: Path, change) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_loads_a_sharded_checkpoint_like_a_single_file(llama_dir, tmp_path):
    path, hf = llama_dir
    sharded = save(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = list(range(1, 20))
    one = prefill_logits(load_model(path, dtype=torch.float32, attention_backend=BACKEND), ids)
    many = prefill_logits(load_model(sharded, dtype=torch.float32, attention_backend=BACKEND), ids)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_in_half_precision_with_a_cache_of_that_dtype(llama_dir, dtype):
    path, _ = llama_dir
    exact = load_model(path, dtype=torch.float32, attention_backend=BACKEND)
    model = load_model(path, dtype=dtype, attention_backend=BACKEND)
    assert all(p.dtype == dtype for p in model.parameters())
    assert model.kv_cache_spec(16).dtype == dtype
    assert model.allocate_kv_cache(3, 16)[0].dtype == dtype
    ids = list(range(5, 30))
    ours, ref = prefill_logits(model, ids), prefill_logits(exact, ids)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()


def test_auto_dtype_takes_the_checkpoint_dtype(llama_dir):
    path, _ = llama_dir
    assert load_model(path, dtype="auto", attention_backend=BACKEND).dtype == torch.float32


def test_rejects_an_unsupported_dtype(llama_dir):
    with pytest.raises(ConfigError, match="float32, float16, bfloat16"):
        load_model(llama_dir[0], dtype=torch.int8, attention_backend=BACKEND)


def test_kv_cache_spec_counts_every_layer(llama_dir):
    model = load_model(llama_dir[0], dtype=torch.float32, attention_backend=BACKEND)
    spec = model.kv_cache_spec(16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.block_size) == (2, 2, 16, 16)
    caches = model.allocate_kv_cache(5, 16)
    assert len(caches) == 2 and caches[0].shape == BACKEND.kv_cache_shape(5, spec)


def test_tied_embeddings_load_without_an_lm_head_tensor(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()
    path = save(hf, tmp_path / "tied")
    model = load_model(path, dtype=torch.float32, attention_backend=BACKEND)
    assert model.lm_head_weight() is model.model.embed_tokens.weight
    ids = list(range(3, 12))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(model, ids) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_missing_tensor_is_named(llama_dir, tmp_path):
    path = edit_weights(llama_dir[0], tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(path, dtype=torch.float32, attention_backend=BACKEND)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    path = edit_weights(llama_dir[0], tmp_path / "u", lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model\.extra\.weight'"):
        load_model(path, dtype=torch.float32, attention_backend=BACKEND)


def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir, tmp_path):
    path = edit_weights(llama_dir[0], tmp_path / "s", lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*\(64, 96\).*\(64, 128\)"):
        load_model(path, dtype=torch.float32, attention_backend=BACKEND)


def test_unsupported_architecture_lists_the_supported_ones(llama_dir, tmp_path):
    path = edit_weights(llama_dir[0], tmp_path / "a", lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigurationError, match="FalconForCausalLM.*LlamaForCausalLM.*MistralForCausalLM"):
        load_model(path, dtype=torch.float32, attention_backend=BACKEND)


def test_refuses_pickled_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **SMALL}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pytorch_model.bin.*safetensors only"):
        load_model(tmp_path, dtype=torch.float32, attention_backend=BACKEND)


def test_unknown_model_names_the_built_ins(tmp_path):
    with pytest.raises(ConfigError, match="kvforge-tiny, kvforge-tiny-draft"):
        load_model(tmp_path / "nowhere", dtype=torch.float32, attention_backend=BACKEND)


def test_backend_lacking_a_feature_the_model_needs_is_refused(tmp_path):
    class NoWindowBackend(AttentionBackend):
        name = "no-window"

        def plan(self, batch): ...

        def write_kv(self, key, value, kv_cache, slot_mapping): ...

        def forward(self, query, kv_cache, plan, out=None): ...

    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=8))
    path = save(hf, tmp_path / "mistral")
    with pytest.raises(UnsupportedConfigurationError, match="no-window.*sliding_window"):
        load_model(path, dtype=torch.float32, attention_backend=NoWindowBackend)


def test_attention_specs_show_the_sliding_window_without_loading_weights(tmp_path):
    config = transformers.MistralConfig(**SMALL, sliding_window=8)
    config.architectures = ["MistralForCausalLM"]
    config.save_pretrained(tmp_path)  # a config and no weights at all
    specs = attention_specs(tmp_path)
    assert len(specs) == 2 and all(s.sliding_window == 8 and s.num_kv_heads == 2 for s in specs)


def test_architecture_registered_in_code_serves_its_checkpoints(llama_dir, tmp_path):
    class RenamedLlama(LlamaForCausalLM):
        pass

    register_architecture("RenamedLlamaForCausalLM", RenamedLlama)
    try:
        path = edit_weights(llama_dir[0], tmp_path / "r", lambda t: None)
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["RenamedLlamaForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
        assert "RenamedLlamaForCausalLM" in architectures()
        assert type(load_model(path, dtype=torch.float32, attention_backend=BACKEND)) is RenamedLlama
    finally:
        registry._ARCHITECTURES.pop("RenamedLlamaForCausalLM")


def test_architecture_from_an_entry_point_is_found(tmp_path, monkeypatch):
    (tmp_path / "fakearch.py").write_text(
        "from kvforge.models.llama import LlamaForCausalLM\nclass FakeArch(LlamaForCausalLM):\n    pass\n")
    info = tmp_path / "fakearch-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakearch\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvforge.models]\nFakeArchForCausalLM = fakearch:FakeArch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    try:
        assert registry.model_class(["FakeArchForCausalLM"]).__name__ == "FakeArch"
    finally:
        registry._ARCHITECTURES.pop("FakeArchForCausalLM", None)
        sys.modules.pop("fakearch", None)


def test_tokenizer_comes_from_transformers_when_the_directory_has_one(llama_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    path = edit_weights(llama_dir[0], tmp_path / "t", lambda t: None)
    fast.save_pretrained(path)
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("hello world") == [2, 3]
    assert tokenizer.decode([2, 3]) == "hello world"
    assert tokenizer.eos_token_id == 1


def test_no_tokenizer_when_the_directory_has_none(llama_dir):
    assert load_tokenizer(llama_dir[0]) is None


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_a_loaded_model_keeps_no_checkpoint_file_mapped(tmp_path):
    # safetensors reads a tensor of the model's dtype in place from its mapping of the file;
    # kept so, the file's pages would stay resident for the model's life beside any packed copy
    model = load_model(save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), tmp_path / "m"),
                       dtype=torch.float32, linear_kernel="torch")
    gc.collect()
    checkpoint = str(tmp_path / "m" / "model.safetensors")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert checkpoint not in Path("/proc/self/maps").read_text()
