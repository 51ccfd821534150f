"""Tiny random base models and PEFT LoRA adapters for them, saved as transformers
and peft save them, and the reference logits of transformers + peft.

The adapters are made with `init_lora_weights=False`, so lora_B is not zero
(PEFT's default makes a fresh adapter a no-op, and a test of it proves nothing),
and lora_B is scaled up (`b_gain`) so an adapter changes the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
# The layers each architecture's adapters may target, as PEFT names them.
TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


def save_base(arch: str, path: Path, seed: int = 0) -> Path:
    """A two-layer random `arch` ("llama": GQA 4/2 heads; "gpt2") with hidden size 64 and
    vocabulary 128, its biases and norms randomised too, saved under `path`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**LLAMA) if arch == "llama" else transformers.GPT2Config(**GPT2)
    config.eos_token_id = config.bos_token_id = None  # never stop early, and no out-of-vocabulary ids
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # zeros and ones as initialised: make them matter
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)
    return path


def load_hf(base_dir: Path, adapter_dir: Path | None = None):
    """The transformers model of `base_dir` in float32, with the PEFT adapter of `adapter_dir` when given."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).eval()


def save_adapter(base_dir: Path, path: Path, *, r: int = 4, alpha: float = 8, target_modules=None,
                 use_rslora: bool = False, seed: int = 0, b_gain: float = 4.0, **config) -> Path:
    """A random PEFT LoRA adapter for the model in `base_dir`, saved under `path`
    (`adapter_config.json`, `adapter_model.safetensors`). `config` goes to
    `peft.LoraConfig` (`rank_pattern`, `layers_to_transform`, ...)."""
    import peft

    model = load_hf(base_dir)
    arch = "gpt2" if model.config.model_type == "gpt2" else "llama"
    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules or TARGETS[arch]),
                           use_rslora=use_rslora, init_lora_weights=False, **config)
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(b_gain)
    adapted.save_pretrained(path)
    return path


def reference_logits(base_dir: Path, adapter_dir: Path | None, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits of every position of each sequence, one full forward pass each
    (no cache), from transformers (+ peft with `adapter_dir`)."""
    model = load_hf(base_dir, adapter_dir)
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in sequences]
