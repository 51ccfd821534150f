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
