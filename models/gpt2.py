"""GPT-2: learned positions, LayerNorm, GELU MLP, multi-head attention, tied embeddings."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import AttentionLayerSpec

from .base import CausalLM, ModelConfig, ModelPlan, PagedAttention
from .layers import activation
from .packed_linear import linear_act, linear_add


class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight is stored `[in, out]`, as in its checkpoints."""

    weight_is_in_by_out = True  # so `packed_linear` packs its transpose

    def __init__(self, size_in: int, size_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size_in, size_out))
        self.bias = nn.Parameter(torch.zeros(size_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int, spec: AttentionLayerSpec):
        super().__init__()
        self.c_attn = Conv1D(hidden, 3 * hidden)
        self.c_proj = Conv1D(hidden, hidden)
        self.attn = PagedAttention(spec)

    def forward(self, x, kv_cache, plan, residual=None):
        spec = self.attn.spec
        tokens = x.shape[0]
        q, k, v = self.c_attn(x).view(tokens, 3, spec.num_heads, spec.head_size).unbind(1)
        out = self.attn(q, k, v, kv_cache, plan)
        return linear_add(self.c_proj, out.reshape(out.shape[0], spec.num_heads * spec.head_size), plan.select(residual))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str):
        super().__init__()
        self.c_fc = Conv1D(hidden, inner)
        self.c_proj = Conv1D(inner, hidden)
        self.act = act
        activation(act)  # refuse an unknown activation at construction

    def forward(self, x, residual=None):
        return linear_add(self.c_proj, linear_act(self.c_fc, x, self.act), residual)


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, spec: AttentionLayerSpec):
        super().__init__()
        hidden, eps = config["n_embd"], config.value("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(hidden, spec)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(hidden, config.value("n_inner", 4 * hidden), config.value("activation_function", "gelu_new"))

    def forward(self, x, kv_cache, plan):
        x = self.attn(self.ln_1(x), kv_cache, plan, residual=x)
        return self.mlp(self.ln_2(x), residual=x)


class GPT2Transformer(nn.Module):
    def __init__(self, config: ModelConfig, specs: list[AttentionLayerSpec]):
        super().__init__()
        hidden = config["n_embd"]
        self.wte = nn.Embedding(config["vocab_size"], hidden)
        self.wpe = nn.Embedding(config["n_positions"], hidden)
        self.h = nn.ModuleList(GPT2Block(config, spec) for spec in specs)
        self.ln_f = nn.LayerNorm(hidden, eps=config.value("layer_norm_epsilon", 1e-5))


class GPT2LMHeadModel(CausalLM):
    """GPT-2. The output projection is always the token embedding (tied)."""

    tied_keys = ("lm_head.weight",)
    computes_output_rows_only = True
    # Old checkpoints store the causal-mask buffers; we never need them.
    ignored_suffixes = ("attn.bias", "attn.masked_bias")

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.max_model_len = int(config["n_positions"])
        heads, hidden = config["n_head"], config["n_embd"]
        head = hidden // heads
        # reorder_and_upcast_attn only changes half-precision rounding inside attention; ignored.
        self.layer_specs = []
        for i in range(config["n_layer"]):
            scale = head ** -0.5 if config.value("scale_attn_weights", True) else 1.0
            if config.value("scale_attn_by_inverse_layer_idx", False):
                scale /= i + 1
            self.layer_specs.append(AttentionLayerSpec(num_heads=heads, num_kv_heads=heads, head_size=head, scale=scale))
        self.transformer = GPT2Transformer(config, self.layer_specs)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Checkpoints saved from the bare GPT2Model lack the `transformer.` prefix."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                plan: ModelPlan) -> torch.Tensor:
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions)
        last = len(t.h) - 1
        for i, (block, kv_cache) in enumerate(zip(t.h, kv_caches)):
            x = block(x, kv_cache, plan.for_last_layer() if i == last else plan)
        return t.ln_f(x)

    def lm_head_weight(self) -> torch.Tensor:
        return self.transformer.wte.weight
