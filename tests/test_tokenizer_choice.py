"""The tokenizer class AutoTokenizer picks, remembered per model directory
(models/tokenizer_choice.py): the same tokenizer, without importing the model's
config class on later loads; a changed directory or a broken cache asks
AutoTokenizer again."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from kvforge.models import load_tokenizer
from kvforge.models import tokenizer_choice

sys.path.insert(0, str(Path(__file__).parent))
from byte_hf_tokenizer import save_byte_tokenizer

TEXTS = ["hello world", "Grüße, 世界! 🙂", "  spaces\tand\nnewlines  ", ""]
CONFIG_MODULE = "transformers.models.llama.configuration_llama"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / tokenizer_choice.CACHE_FILE


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A Llama config (its config class is what AutoTokenizer imports) and a byte-level tokenizer."""
    path = tmp_path / "model"
    path.mkdir()
    transformers.LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(path)
    save_byte_tokenizer(path)
    return path


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.get_vocab() == b.get_vocab()


def autotokenizer_fails(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("AutoTokenizer was asked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)


def test_the_second_load_skips_autotokenizer_and_gives_the_same_tokenizer(cache, model_dir, monkeypatch):
    expected = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    first = load_tokenizer(model_dir)
    same_tokenizer(first, expected)
    remembered = json.loads(cache.read_text())
    assert list(remembered.values()) == [f"{type(expected).__module__}:{type(expected).__qualname__}"]
    autotokenizer_fails(monkeypatch)
    same_tokenizer(load_tokenizer(model_dir), expected)


def test_a_process_with_the_class_remembered_does_not_import_the_config_class(cache, model_dir):
    script = (f"import sys; from kvforge.models import load_tokenizer; t = load_tokenizer({str(model_dir)!r}); "
              f"print(t.encode('hello'), {CONFIG_MODULE!r} in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs[0][-1] == "True"  # the first load asks AutoTokenizer, which imports the config class
    assert runs[1][-1] == "False"
    assert runs[0][:-1] == runs[1][:-1]


def test_a_changed_tokenizer_config_asks_autotokenizer_again(cache, model_dir, monkeypatch):
    load_tokenizer(model_dir)
    config = model_dir / "tokenizer_config.json"
    before, stat = config.read_text(), config.stat()
    changed = before.replace('"model_max_length": 1', '"model_max_length": 2')
    assert changed != before
    config.write_text(changed)  # the same size, and the same time below: read whole, not by its stat
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    autotokenizer_fails(monkeypatch)
    with pytest.raises(AssertionError, match="AutoTokenizer was asked"):
        load_tokenizer(model_dir)


def test_a_changed_transformers_version_asks_autotokenizer_again(cache, model_dir, monkeypatch):
    load_tokenizer(model_dir)
    # the module as imported now: importing peft (other tests) puts a new one in sys.modules
    current = importlib.import_module("transformers")
    monkeypatch.setattr(current, "__version__", current.__version__ + ".post1")
    autotokenizer_fails(monkeypatch)
    with pytest.raises(AssertionError, match="AutoTokenizer was asked"):
        load_tokenizer(model_dir)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"x": "os:system"})])
def test_a_broken_cache_costs_only_the_shortcut(cache, model_dir, content):
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    key = tokenizer_choice.fingerprint(model_dir)
    if content.startswith("{\"x\""):  # an entry naming something outside transformers is never imported
        cache.write_text(json.dumps({key: "os:system"}))
    same_tokenizer(load_tokenizer(model_dir),
                   transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))
    assert json.loads(cache.read_text())[key].startswith("transformers.")


def test_an_unwritable_cache_still_loads(tmp_path, model_dir, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    same_tokenizer(load_tokenizer(model_dir),
                   transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))


def test_a_class_defined_outside_transformers_is_not_remembered(cache, model_dir, monkeypatch):
    class Custom:
        pass

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Custom())
    assert isinstance(load_tokenizer(model_dir), Custom)
    assert not cache.exists()


def test_the_cache_keeps_the_newest_directories(cache, model_dir, monkeypatch):
    monkeypatch.setattr(tokenizer_choice, "MAX_ENTRIES", 2)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"old": "transformers.x:Y", "older": "transformers.x:Z"}))
    load_tokenizer(model_dir)
    remembered = json.loads(cache.read_text())
    assert list(remembered) == ["older", tokenizer_choice.fingerprint(model_dir)]


def test_a_remembered_class_that_fails_to_load_costs_only_the_shortcut(cache, model_dir, monkeypatch):
    expected = load_tokenizer(model_dir)  # remembered

    class Broken:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            raise OSError("planted")

    monkeypatch.setattr(tokenizer_choice, "_class", lambda name: Broken)
    calls = []
    auto = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(1) or auto(*a, **k))
    same_tokenizer(load_tokenizer(model_dir), expected)
    assert calls == [1]


def test_a_failed_write_leaves_no_file_behind(cache, model_dir, monkeypatch):
    def fail(*args):
        raise OSError("planted")

    monkeypatch.setattr(tokenizer_choice.os, "replace", fail)
    same_tokenizer(load_tokenizer(model_dir),
                   transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))
    assert list(cache.parent.iterdir()) == []
