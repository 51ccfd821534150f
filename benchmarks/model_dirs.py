"""Model directories for the benchmarks: Llama-style models built from a
transformers config with random weights (timing does not need trained weights),
saved as ordinary Hugging Face directories with a byte-level BPE tokenizer, so
every peer (kvforge, transformers, vLLM) loads the very same files.

    path = model_dir("bench-llama-50m")    # built once, then reused from the cache

A synthetic model's cached directory is named after its config's digest too, so
a changed config builds a new directory instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# name -> LlamaConfig arguments. ~50M: 10 layers of 512 (31.5M) + untied 16k embeddings (16.8M).
SYNTHETIC = {
    "bench-llama-tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "bench-llama-50m": dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
    # 24.65M: 8 layers of 512 (23.6M) + untied 1k embeddings (1.05M); the batch1 scenario's model, beside llama.cpp.
    "bench-llama-25m": dict(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
}
# The same models with room for the long-prompt scenario's 4k-token prompts.
SYNTHETIC["bench-llama-tiny-8k"] = {**SYNTHETIC["bench-llama-tiny"], "max_position_embeddings": 8192}
SYNTHETIC["bench-llama-50m-8k"] = {**SYNTHETIC["bench-llama-50m"], "max_position_embeddings": 8192}
# The default bench models: with --quick, and otherwise.
QUICK_MODEL = "bench-llama-tiny"
FULL_MODEL = "bench-llama-50m"


def cache_root() -> Path:
    base = os.environ.get("KVFORGE_BENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvforge", "bench-models")
    return Path(base)


def model_dir(name: str) -> Path:
    """A local model directory for `name`: a synthetic name (built on first use),
    a built-in kvforge model, or a path."""
    if name in SYNTHETIC:
        path = cache_root() / f"{name}-{config_digest(SYNTHETIC[name])}"
        if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
            build(path, SYNTHETIC[name])
        return path
    from kvforge.models import resolve_model_dir

    return resolve_model_dir(name)


def config_digest(arguments: dict) -> str:
    """A short digest of a synthetic model's config arguments, for its cache directory's name."""
    return hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:10]


def max_positions(path: Path) -> int | None:
    """The longest sequence the model directory's config admits (None when it does not say)."""
    return json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")


def scenario_model_dir(scenario, model: str, path: Path) -> Path:
    """The model directory `scenario` runs: `path` (of `model`) when it holds the
    longest request of a scenario that names its own model (long-prompt), or
    for any other scenario; else, for a default bench model, the scenario's own
    model (the same one with more positions); else a ConfigError. A scenario
    with a `default_model` runs it in place of the full default bench model."""
    from kvforge.core import ConfigError

    if scenario.default_model is not None and model == FULL_MODEL:
        return model_dir(scenario.default_model)
    need, limit = scenario.longest(), max_positions(path)
    if scenario.model is None or limit is None or need <= limit:  # the others run as they always did
        return path
    if model in (QUICK_MODEL, FULL_MODEL):
        return model_dir(scenario.model)
    raise ConfigError(f"scenario {scenario.name}: its longest request needs {need} positions but model {model} "
                      f"admits {limit} (max_position_embeddings); pass --model with at least {need}, e.g. "
                      f"--model {scenario.model}, or drop the scenario")


def build(path: Path, arguments: dict, seed: int = 0) -> None:
    """Save a random-weight Llama and a byte-level BPE tokenizer under `path`."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(arguments["vocab_size"])
    config = transformers.LlamaConfig(**arguments, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on Python's standard library sources: enough for
    vLLM and transformers to load a tokenizer; the benchmarks feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def corpus(limit: int = 4_000_000):
    """Lines of the standard library's sources, about `limit` characters."""
    root = Path(os.__file__).parent
    total = 0
    for file in sorted(root.glob("*.py")):
        text = file.read_text(errors="ignore")
        yield text
        total += len(text)
        if total > limit:
            return


if __name__ == "__main__":
    for name in sys.argv[1:] or list(SYNTHETIC):
        print(name, model_dir(name))
