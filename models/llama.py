"""The Llama family: Llama (with Llama-3 rope scaling), Mistral (sliding window),
Qwen2 (QKV bias) and Qwen3 (q/k norm). One decoder, four small flavours."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import AttentionLayerSpec
from kvforge.core.errors import ConfigError

from .base import CausalLM, ModelConfig, ModelPlan, PagedAttention
from .layers import RMSNorm, RotaryEmbedding, activation, rope_inv_freq, rotate
from .packed_linear import linear_act, linear_add, linear_mul


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)`; meta tensors (the layers of another pipeline stage, never
    loaded) by their shapes alone: torch.cat on the meta device imports torch._dynamo."""
    if tensors[0].is_meta:
        rows = sum(t.shape[0] for t in tensors)
        return torch.empty((rows, *tensors[0].shape[1:]), dtype=tensors[0].dtype, device="meta")
    return torch.cat(tensors)


class LlamaAttention(nn.Module):
    """Attention with the checkpoint's q_proj, k_proj and v_proj, which `fuse_qkv`
    (run by the loader once the weights are in) merges into one `qkv_proj`."""

    def __init__(self, config: ModelConfig, spec: AttentionLayerSpec, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        hidden, heads, kv_heads, head = config["hidden_size"], spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_proj = nn.Linear(hidden, heads * head, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head, bias=qkv_bias)
        self.qkv_proj: nn.Module | None = None
        self.o_proj = nn.Linear(heads * head, hidden, bias=o_bias)
        if qk_norm:
            eps = config.value("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = RMSNorm(head, eps), RMSNorm(head, eps)
        self.qk_norm = qk_norm
        self.attn = PagedAttention(spec)

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Replace q_proj, k_proj and v_proj by `qkv_proj`, their weights (and biases)
        stacked: one GEMM instead of three, and q and k side by side for rotary."""
        if self.qkv_proj is not None:
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        bias = parts[0].bias is not None
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias, device="meta")
        fused.weight = nn.Parameter(_stacked([p.weight for p in parts]), requires_grad=False)
        if bias:
            fused.bias = nn.Parameter(_stacked([p.bias for p in parts]), requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused

    def forward(self, x, cos_sin, kv_cache, plan, residual=None):
        """The attention output, plus `residual` when given (added inside the o_proj GEMM when packed)."""
        spec = self.attn.spec
        tokens, heads, kv_heads, head = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_size
        if self.qkv_proj is None:
            raise ConfigError("q, k and v are not fused yet: call the model's finish_loading() once its weights "
                              "are in (load_model does)")
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, head)
        v = qkv[:, heads + kv_heads:]
        if self.qk_norm:
            q = rotate(self.q_norm(qkv[:, :heads]), *cos_sin)
            k = rotate(self.k_norm(qkv[:, heads:heads + kv_heads]), *cos_sin)
        else:  # q and k sit side by side: one rotation for both
            q, k = rotate(qkv[:, :heads + kv_heads], *cos_sin).split([heads, kv_heads], dim=1)
        out = self.attn(q, k, v, kv_cache, plan)
        return linear_add(self.o_proj, out.reshape(out.shape[0], heads * head), plan.select(residual))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, bias: bool):
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one GEMM, set by cpp_linear.use_cpp_linears
        self.act = config.value("hidden_act", "silu")
        activation(self.act)  # refuse an unknown activation at construction

    def forward(self, x, residual=None):
        """`down(act(gate(x)) * up(x))`, plus `residual` when given; packed, no pass outside the GEMMs."""
        if self.gate_up_proj is not None:
            gated = self.gate_up_proj(x)
        else:
            gated = linear_mul(self.up_proj, x, linear_act(self.gate_proj, x, self.act))
        return linear_add(self.down_proj, gated, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: AttentionLayerSpec, flavour: "LlamaForCausalLM"):
        super().__init__()
        eps = config.value("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = LlamaAttention(config, spec, flavour.qkv_bias(config), flavour.o_bias(config), flavour.qk_norm)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = LlamaMLP(config, bool(config.value("mlp_bias", False)))

    def forward(self, x, cos_sin, kv_cache, plan):
        x = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, plan, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, specs: list[AttentionLayerSpec], flavour: "LlamaForCausalLM"):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, spec, flavour) for spec in specs)
        self.norm = RMSNorm(config["hidden_size"], config.value("rms_norm_eps", 1e-6))


class LlamaForCausalLM(CausalLM):
    """Llama: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention."""

    qk_norm = False
    tied_keys = ("lm_head.weight",)
    computes_output_rows_only = True
    # Every layer of a step in one C++ call, set by the loader when the layers allow it
    # (cpp_decoder_stack.py; `decoder_stack_reason` says why not otherwise).
    decoder_stack = None
    decoder_stack_reason: str | None = "not loaded by load_model"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        heads = config["num_attention_heads"]
        kv_heads = config.value("num_key_value_heads", heads)
        head = config.value("head_dim", config["hidden_size"] // heads)
        self.layer_specs = [
            AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head,
                               sliding_window=self.sliding_window(config, i))
            for i in range(config["num_hidden_layers"])
        ]
        self.model = LlamaModel(config, self.layer_specs, self)
        self.tied = bool(config.value("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.rotary = RotaryEmbedding(rope_inv_freq(config, head))

    # Flavour hooks, overridden by Mistral and Qwen

    def qkv_bias(self, config: ModelConfig) -> bool:
        return bool(config.value("attention_bias", False))

    def o_bias(self, config: ModelConfig) -> bool:
        return bool(config.value("attention_bias", False))

    def sliding_window(self, config: ModelConfig, layer: int) -> int | None:
        """The layer's window, from `layer_types` when the config has it."""
        types = config.get("layer_types")
        if types is not None and types[layer] != "sliding_attention":
            return None
        return config.get("sliding_window") if types is not None else None

    # The step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                plan: ModelPlan) -> torch.Tensor:
        stack = self.decoder_stack
        if stack is not None and stack.refusal(plan) is None:
            return stack(input_ids, positions, kv_caches, plan)
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype, plan.batch.max_seq_len)
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(x, cos_sin, kv_cache, plan.for_last_layer() if i == last else plan)
        return self.model.norm(x)

    def lm_head_weight(self) -> torch.Tensor | None:
        return self.model.embed_tokens.weight if self.tied else getattr(self.lm_head, "weight", None)

    def finish_block(self, block: nn.Module) -> None:
        """Fuse the layer's q, k and v projections (see `LlamaAttention.fuse_qkv`)."""
        block.self_attn.fuse_qkv()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding attention window on every layer."""

    def sliding_window(self, config: ModelConfig, layer: int) -> int | None:
        if config.get("layer_types") is not None:
            return super().sliding_window(config, layer)
        return config.get("sliding_window")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q, k and v projections."""

    def qkv_bias(self, config: ModelConfig) -> bool:
        return True

    def o_bias(self, config: ModelConfig) -> bool:
        return False

    def sliding_window(self, config: ModelConfig, layer: int) -> int | None:
        if config.get("layer_types") is not None:
            return super().sliding_window(config, layer)
        # Older configs: layers from max_window_layers on slide, when use_sliding_window is set.
        if config.get("use_sliding_window") and layer >= config.value("max_window_layers", 0):
            return config.get("sliding_window")
        return None


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3: RMSNorm over each head's queries and keys before rotary; bias only if configured."""

    qk_norm = True

    def qkv_bias(self, config: ModelConfig) -> bool:
        return bool(config.value("attention_bias", False))

    def o_bias(self, config: ModelConfig) -> bool:
        return bool(config.value("attention_bias", False))
