"""PEFT-format LoRA adapters with random weights for a Llama-style model
directory, written once and reused (the `lora` scenario's adapters). Needs only
torch and safetensors, so the vLLM runner builds the very same files.

    paths = adapter_dirs(model_dir, count=16, rank=8)

Each adapter targets every projection (q, k, v, o, gate, up, down) of every
layer; adapter `i` of a rank has its own seed, so adapters differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of one layer."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head
    return {"q_proj": (hidden, heads * head), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
            "down_proj": (inner, hidden)}


def write_adapter(path: Path, config: dict, rank: int, seed: int, base_model: str) -> None:
    """One adapter: A ~ N(0, 1/in), B ~ N(0, 1/rank), alpha = 2 * rank."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in projection_shapes(config).items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) / rank ** 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": base_model}))


def run_adapters(workload: dict, options: dict) -> list[tuple[str, int, str]] | None:
    """(name, id, directory) of each adapter of a run with `lora_adapters`
    (`{"count": C, "rank": R}`), as both runners name them; None without."""
    spec = options.get("lora_adapters")
    if not spec:
        return None
    paths = adapter_dirs(workload["model_dir"], spec["count"], spec["rank"])
    return [(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]


def adapter_dirs(model_dir: str, count: int, rank: int) -> list[str]:
    """`count` adapters of `rank` for the model in `model_dir`, built on first use
    beside the model (or under KVFORGE_BENCH_CACHE's lora/ when the model's
    directory is not writable)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    root = Path(model_dir) / "lora-adapters"
    if not os.access(model_dir, os.W_OK):
        root = Path(os.environ.get("KVFORGE_BENCH_CACHE", os.path.expanduser("~/.cache/kvforge/bench-models")))
        root = root / "lora" / Path(model_dir).name
    paths = []
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(path, config, rank, seed=1000 * rank + i, base_model=str(model_dir))
        paths.append(str(path))
    return paths
