"""Tiny random-weight Hugging Face model directories that vLLM and kvforge both load,
for tests/test_vllm_plugin.py: a Llama (grouped-query attention) and a Qwen2 (query,
key and value biases, 4 query heads per KV head, a sliding window on every layer),
each with a byte-level BPE tokenizer (benchmarks/model_dirs.py's)."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    # max_window_layers=0: every layer slides (vLLM refuses a mix for Qwen2)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, use_sliding_window=True,
                                                      sliding_window=24, max_window_layers=0)),
}
SLIDING_WINDOW = {"llama": None, "qwen2": 24}


def build(root: Path, name: str, tokenizer) -> Path:
    """Save model `name` of MODELS (seeded random weights, float32) and `tokenizer` under `root/name`."""
    import torch
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    path = root / name
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # larger weights than the initializer's, so greedy tokens differ from step to step
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
