"""Damaged checkpoints, non-finite weights and misspelt model names are named as such."""

from __future__ import annotations

import logging
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvforge.core import ConfigError
from kvforge.models import load_model, resolve_model_dir

MODEL = "kvforge-tiny-draft"


@pytest.fixture
def model_copy(tmp_path):
    source = resolve_model_dir(MODEL)
    if not (source / "model.safetensors").is_file():
        pytest.skip(f"built-in model {MODEL} is not shipped in this checkout")
    return shutil.copytree(source, tmp_path / MODEL)


@pytest.mark.parametrize("keep", [100, 0.5])
def test_a_truncated_checkpoint_is_named_and_called_damaged(model_copy, keep):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ConfigError) as excinfo:
        load_model(model_copy)
    message = str(excinfo.value)
    assert str(weights) in message and "damaged" in message and "download or save it again" in message


def test_loading_warns_about_non_finite_weights_naming_the_tensor(model_copy, caplog):
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)[0]
    tensors[name][0, 1] = float("nan")
    tensors[name][1, 0] = float("inf")
    save_file(tensors, weights)
    with caplog.at_level(logging.WARNING, logger="kvforge.models.loader"):
        load_model(model_copy)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert repr(name) in warning.getMessage() and "2 non-finite values" in warning.getMessage()


def test_a_clean_checkpoint_loads_without_warnings(model_copy, caplog):
    with caplog.at_level(logging.WARNING, logger="kvforge.models.loader"):
        load_model(model_copy)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_misspelt_builtin_model_name_gets_did_you_mean():
    with pytest.raises(ConfigError, match=r"'kvforge-tinyy'.*did you mean 'kvforge-tiny'\?"):
        resolve_model_dir("kvforge-tinyy")
    with pytest.raises(ConfigError) as excinfo:
        resolve_model_dir("/no/such/model/dir")
    assert "did you mean" not in str(excinfo.value)


def test_a_nan_weight_ends_only_the_requests_it_reaches(tmp_path, caplog):
    """The issue's case end to end: a NaN in one untied embedding row reaches only the
    prompts holding that token; they end with an error, the others run as without them."""
    import torch
    import transformers

    from kvforge import LLM, SamplingParams

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.embed_tokens.weight"][13] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="kvforge.models.loader"):
        llm = LLM(str(tmp_path), device="cpu", cache={"num_blocks": 32, "block_size": 4})
    assert any("'model.embed_tokens.weight'" in r.getMessage() for r in caplog.records)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    clean = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
    mixed = llm.generate(prompt_token_ids=[clean[0], [1, 13, 3], clean[1]], sampling_params=params)
    assert [o.finish_reason for o in mixed] == ["length", "error", "length"]
    assert "non-finite logits" in mixed[1].error
    alone = llm.generate(prompt_token_ids=clean, sampling_params=params)
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids]
