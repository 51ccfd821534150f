"""PEFT-format LoRA adapters for kvforge-tiny, written by tests that serve them.

kvforge-tiny is a Llama (hidden 256, 3 layers, 8 query heads and 4 KV heads of
32, so q_proj is 256 -> 256 and v_proj 256 -> 128). An adapter here changes
q_proj and v_proj of every layer with random A and B drawn from a fixed seed;
B is scaled up (PEFT initialises it to zero, a no-op) so that the adapter
changes the model's greedy output, which the tests assert.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 256
NUM_LAYERS = 3
OUT_FEATURES = {"q_proj": 256, "v_proj": 128}


def write_tiny_adapter(directory: str | Path, seed: int, rank: int = 8, alpha: int = 16,
                       b_scale: float = 2.0) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` of a rank-`rank`
    adapter of kvforge-tiny into `directory` (created) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module, out_features in OUT_FEATURES.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=generator) / HIDDEN ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * b_scale
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(OUT_FEATURES),
              "bias": "none", "base_model_name_or_path": "kvforge-tiny", "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
