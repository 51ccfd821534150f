"""kvforge.models: model definitions on the paged interface, checkpoint loading,
and the built-in tiny models.

    model = load_model("kvforge-tiny", dtype=torch.float32, device="cpu", attention_backend=Backend)
    tokenizer = load_tokenizer("kvforge-tiny")
"""

from .base import CausalLM, ModelConfig, ModelPlan, PagedAttention
from .loader import BUILTIN_MODELS, attention_specs, load_model, resolve_model_dir
from .registry import architectures, register_architecture
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "ByteTokenizer",
    "CausalLM",
    "ModelConfig",
    "ModelPlan",
    "PagedAttention",
    "architectures",
    "attention_specs",
    "load_model",
    "load_tokenizer",
    "register_architecture",
    "resolve_model_dir",
]
