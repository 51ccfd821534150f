"""The built-in tiny models load, tokenize, generate, and score their documented loss."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvforge.models import BUILTIN_MODELS, load_model, load_tokenizer, resolve_model_dir

sys.path.insert(0, str(Path(__file__).parent))  # the test-local driver sits beside this file
from model_driver import PagedDriver, cpu_backends

BACKEND = cpu_backends()[0]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def evaluation(name: str) -> dict:
    return json.loads((resolve_model_dir(name) / "eval.json").read_text())


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_model_loads_with_its_byte_tokenizer(name):
    model = load_model(name, dtype=torch.float32, device="cpu", attention_backend=BACKEND)
    tokenizer = load_tokenizer(name)
    assert model.vocab_size == 259 and model.eos_token_id == tokenizer.eos_token_id == 257
    assert tokenizer.encode("é") == [0xC3, 0xA9]
    assert tokenizer.decode(tokenizer.encode("def f(x):") + [257]) == "def f(x):"


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_model_generates_the_same_greedy_text_for_any_block_size(name):
    model = load_model(name, dtype=torch.float32, device="cpu", attention_backend=BACKEND)
    tokenizer = load_tokenizer(name)
    prompts = [tokenizer.encode("import os\nimport sys\n\n\ndef "), tokenizer.encode("class ")]
    outputs = []
    for block_size, permute in ((16, False), (32, True)):
        driver = PagedDriver(model, block_size, len(prompts), 80, permute=permute)
        outputs.append(driver.greedy(prompts, 24)[2])
    assert torch.equal(outputs[0], outputs[1])
    assert int(outputs[0].min()) >= 0 and int(outputs[0].max()) < model.vocab_size
    assert isinstance(tokenizer.decode(outputs[0][0].tolist()), str)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_documented_loss_is_reproduced_on_the_heldout_slice(name):
    """`eval.json` records the bits per byte the training script measured on the
    shipped held-out slice; kvforge's paged forward must give the same number."""
    recorded = evaluation(name)
    model = load_model(name, dtype=torch.float32, device="cpu", attention_backend=BACKEND)
    data = (resolve_model_dir(name) / "heldout_slice.txt").read_bytes()
    ids = [256, *data]  # <bos> then the bytes, as the training script scores it
    window = recorded["slice_window"]
    windows = [ids[start:start + window + 1] for start in range(0, len(ids) - 1, window)]
    driver = PagedDriver(model, 16, len(windows), window)
    logits = driver.step([w[:-1] for w in windows])  # every window is its own sequence, one ragged prefill
    nats = sum(F.cross_entropy(out, torch.tensor(w[1:]), reduction="sum").item() for out, w in zip(logits, windows))
    bits = nats / (len(ids) - 1) / math.log(2)
    assert bits == pytest.approx(recorded["slice_bits_per_byte"], abs=2e-3)


def test_draft_is_much_smaller_than_the_main_model():
    assert evaluation("kvforge-tiny-draft")["parameters"] * 5 < evaluation("kvforge-tiny")["parameters"]


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_docs_report_the_shipped_heldout_loss(name):
    assert f"| {evaluation(name)['heldout_bits_per_byte']} |" in DOCS.read_text()
