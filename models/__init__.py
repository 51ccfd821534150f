"""kvforge.models: model definitions on the paged interface, checkpoint loading,
and the built-in tiny models.

    model = load_model("kvforge-tiny", dtype=torch.float32, device="cpu", attention_backend=Backend)
    tokenizer = load_tokenizer("kvforge-tiny")
"""

from .base import CausalLM, ModelConfig, ModelPlan, PagedAttention
from .loader import BUILTIN_MODELS, attention_specs, load_model, resolve_model_dir
from .lora_adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from .lora_layers import LoRAState, enable_lora
from .registry import architectures, register_architecture
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "ByteTokenizer",
    "CausalLM",
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRAState",
    "ModelConfig",
    "ModelPlan",
    "PagedAttention",
    "architectures",
    "attention_specs",
    "enable_lora",
    "load_model",
    "load_peft_adapter",
    "load_tokenizer",
    "register_architecture",
    "resolve_model_dir",
]
