"""A Llama-family model's forward (token embedding, decoder layers, final norm)
run in one C++ call per step.

`LlamaForCausalLM.forward` runs its layers one by one in Python: some ten torch
ops per layer (RMSNorm, the q/k/v GEMM, rotary, the KV write, attention, o_proj
with the residual, RMSNorm, gate-and-up, down with the residual), each a Python
call and a dispatch. At batch 1 on a small model those fixed costs are a large
share of the step (docs/benchmarks.md, "batch1"). `CppDecoderStack` holds each
layer's weights, the embedding and the final norm in
`torch.classes.kvforge_cpp.DecoderStack` (kernels/decoder_stack.cpp), registered
once at load, and runs a step's forward in one call that invokes the same C++
kernel functions the per-layer ops run, in the same order: its hidden states are
bitwise the Python path's, for any batch (prefill, decode, mixed, output rows
only).

`decoder_stack_for(model)` (the loader calls it) builds one when everything in
the layers is something the C++ call runs, and otherwise says why not:
`decoder_stack_unavailable`. Per step, `CppDecoderStack.refusal(plan)` checks
what can change after load (the attention backend, a quantized KV cache); the
model then runs its layers in Python.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import dtype_name

from .cpp_linear import FUSED_ACTIVATIONS, CppGateUp, CppLinear
from .layers import RMSNorm
from .quantized_linear import CPP_DTYPES, Int8GateUp, Int8Linear

# How the C++ class runs a linear layer (decoder_stack.cpp's LinearKind; PLAIN: the LM head only).
PACKED, INT8_WEIGHT, INT8_DYNAMIC, PLAIN = 0, 1, 2, 3
NONE = torch.empty(0)  # the placeholder for an absent tensor (bias, q/k norm, int8 scale)


def linear_entry(layer, name: str) -> tuple[list[torch.Tensor], list[int], str | None]:
    """`layer`'s tensors (weight, bias, scale), its (kind, out_features, has_bias),
    and why the C++ stack cannot run it (None when it can)."""
    if isinstance(layer, (CppLinear, CppGateUp)) and not getattr(layer, "float_out", False):
        bias = layer.bias
        return [layer.packed, NONE if bias is None else bias, NONE], [PACKED, layer.out_features, int(bias is not None)], None
    out_features = layer.out_features if isinstance(layer, (Int8Linear, Int8GateUp)) else 0
    if type(layer) is Int8GateUp:  # its fused weight, run with epilogue silu_mul
        layer = layer.both
    if type(layer) is Int8Linear and layer.weight_int8.is_cpu:
        kind = INT8_WEIGHT if layer.activations == "none" else INT8_DYNAMIC
        if kind == INT8_DYNAMIC and not layer.fused_w8a8:
            return [], [], f"{name} is W8A8 without its C++ kernel"
        bias = layer.bias
        return ([layer.weight_int8, NONE if bias is None else bias, layer.weight_scale],
                [kind, out_features, int(bias is not None)], None)
    return [], [], (f"{name} is a {type(layer).__name__}, not a C++ linear layer (CppLinear, CppGateUp, Int8Linear "
                    "or Int8GateUp)")


def head_entry(model) -> tuple[tuple[list, list] | None, str | None]:
    """(tensors, ints) of the model's LM head for `DecoderStack.set_head`, computing
    what `compute_logits` computes, or why the C++ class cannot run it."""
    head = getattr(model, "lm_head_layer", None)
    if head is None:  # compute_logits: F.linear with the float weight
        weight = model.lm_head_weight()
        if weight is None:
            return None, "the model has no LM head weight"
        return ([weight, NONE, NONE], [PLAIN, weight.shape[0], 0, 0]), None
    if isinstance(head, CppLinear):
        bias = head.bias
        return ([head.packed, NONE if bias is None else bias, NONE],
                [PACKED, head.out_features, int(bias is not None), int(head.float_out)]), None
    found, meta, why_not = linear_entry(head, "the LM head")
    return (None, why_not) if why_not is not None else ((found, [*meta, 0]), None)


def layer_entry(model, index: int, spec_index: int) -> tuple[tuple[list, list, list] | None, str | None]:
    """(tensors, ints, floats) of layer `index` for `DecoderStack.add_layer`, or why not."""
    layer = model.model.layers[index]
    attn, mlp, spec = layer.self_attn, layer.mlp, model.layer_specs[index]
    where = f"layer {index}'s"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    for norm in norms:
        if type(norm) is not RMSNorm or norm.kernel != "cpp":
            return None, f"{where} RMSNorm does not run on the C++ kernel (linear_kernel 'cpp' or 'auto' sets it)"
    if spec.alibi_slopes is not None:
        return None, f"{where} attention uses ALiBi"
    if attn.qkv_proj is None:
        return None, f"{where} q, k and v are not fused"
    if getattr(mlp, "act", None) not in FUSED_ACTIVATIONS:
        return None, f"{where} MLP activation is {getattr(mlp, 'act', None)!r}, not SiLU"
    fused = mlp.gate_up_proj is not None
    linears = [(attn.qkv_proj, "qkv_proj"), (attn.o_proj, "o_proj")]
    linears += ([(mlp.gate_up_proj, "gate_up_proj"), (None, "")] if fused
                else [(mlp.gate_proj, "gate_proj"), (mlp.up_proj, "up_proj")])
    linears.append((mlp.down_proj, "down_proj"))
    tensors = [norm.weight for norm in norms[:2]]
    tensors += [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [NONE, NONE]
    ints = [spec.num_heads, spec.num_kv_heads, spec.head_size, int(spec.sliding_window or 0), int(attn.qk_norm),
            spec_index, int(fused)]
    for module, name in linears:
        if module is None:
            tensors += [NONE, NONE, NONE]
            ints += [PACKED, 0, 0]
            continue
        found, meta, why_not = linear_entry(module, f"{where} {name}")
        if why_not is not None:
            return None, why_not
        tensors += found
        ints += meta
    eps = [layer.input_layernorm.eps, layer.post_attention_layernorm.eps]
    eps += [attn.q_norm.eps, attn.k_norm.eps] if attn.qk_norm else [0.0, 0.0]
    floats = [*map(float, eps), float(spec.softmax_scale), float(spec.logit_soft_cap or 0.0)]
    return (tensors, ints, floats), None


def decoder_stack_unavailable(model) -> str | None:
    """Why `model`'s layers cannot run as one C++ call (None when they can), for what
    is fixed at load: the architecture, the device and dtype, LoRA, the linear,
    RMSNorm and rotary kernels of every layer."""
    from .llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model (Llama, Mistral, Qwen2, Qwen3)"
    if model.device.type != "cpu" or model.dtype not in CPP_DTYPES:
        return (f"the C++ decoder stack runs float32 and bfloat16 CPU models, this one is "
                f"{dtype_name(model.dtype)} on {model.device.type}")
    if getattr(model, "lora", None) is not None:
        return "LoRA adapters are enabled (their updates run in Python around each linear layer)"
    if getattr(model.rotary, "kernel", None) != "cpp":
        return "rotary embeddings do not run on the C++ kernel (linear_kernel 'cpp' or 'auto' sets it)"
    embed, norm = model.model.embed_tokens, model.model.norm
    if type(embed) is not nn.Embedding or embed.max_norm is not None:
        return f"the token embedding ({type(embed).__name__}) is not a plain row lookup (nn.Embedding, no max_norm)"
    if type(norm) is not RMSNorm or norm.kernel != "cpp":
        return "the final RMSNorm does not run on the C++ kernel (linear_kernel 'cpp' or 'auto' sets it)"
    if not len(model.model.layers):
        return "the model has no decoder layers"
    for i in range(len(model.model.layers)):
        _, why_not = layer_entry(model, i, 0)
        if why_not is not None:
            return why_not
    return None


class CppDecoderStack:
    """A loaded model's decoder layers as one `torch.classes.kvforge_cpp.DecoderStack`;
    call it as the layer loop of `LlamaForCausalLM.forward`."""

    def __init__(self, model):
        self.specs = list(dict.fromkeys(model.layer_specs))  # the step's plans, one per distinct spec
        self.last_spec = model.layer_specs[-1]
        self.stack = torch.classes.kvforge_cpp.DecoderStack()
        for i, spec in enumerate(model.layer_specs):
            entry, why_not = layer_entry(model, i, self.specs.index(spec))
            if why_not is not None:
                raise ValueError(f"the C++ decoder stack cannot run this model: {why_not}")
            self.stack.add_layer(*entry)
        norm = model.model.norm
        self.stack.set_ends(model.model.embed_tokens.weight, norm.weight, float(norm.eps))
        head, self.head_reason = head_entry(model)  # None: decode_greedy runs the head
        if head is not None:
            self.stack.set_head(*head)
        self.rotary = model.rotary
        # The backends it runs attention for, by registry name (models do not import
        # backends), and whether they ask for the batch-invariant kernel.
        self._invariant = {"cpp": False, "cpp_batch_invariant": True}
        self._refusals: dict = {}  # backend instance -> why the stack cannot serve it (None: it can)

    def refusal(self, plan) -> str | None:
        """Why this step's plan must run in Python (None when the stack serves it): an
        attention backend other than cpp (or cpp_batch_invariant), or a quantized KV cache."""
        for backend, _ in plan.backends.values():
            if backend not in self._refusals:
                self._refusals[backend] = self._backend_refusal(backend)
            if self._refusals[backend] is not None:
                return self._refusals[backend]
        return None

    def _backend_refusal(self, backend) -> str | None:
        if backend.name not in self._invariant:
            return f"attention backend {backend.name!r}: the C++ decoder stack calls the cpp backend's kernel"
        if backend.cache.quantized:
            return "a quantized KV cache (its writes and views run in Python)"
        return None

    def _plans(self, plan) -> list[torch.Tensor]:
        """The four CppPlan tensors of each distinct layer spec, in `specs` order."""
        plans = []
        for spec in self.specs:
            p = plan.backends[spec][1]
            plans += (p.query_start_loc, p.seq_lens, p.context_lens, p.block_table)
        return plans

    def greedy_burst(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], plan,
                     steps: int, stop_ids: list[int], max_seconds: float) -> list[list[int]] | None:
        """Up to `steps` greedy decode steps of a plain decode batch in one call
        (`DecoderStack.decode_greedy`): the tokens of each step, every row's; it ends
        after a step in which every row sampled one of `stop_ids` or which brought the
        call's time to `max_seconds`, and before one whose logits are not finite. None where the class cannot: no head it runs
        (`head_reason`), output rows, or a plan it refuses."""
        return self._burst("decode_greedy", input_ids, positions, kv_caches, plan, steps, stop_ids, max_seconds)

    def sampled_burst(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], plan,
                      steps: int, stop_ids: list[int], max_seconds: float, settings: tuple, u: torch.Tensor,
                      history: tuple) -> list[list[int]] | None:
        """`greedy_burst` with each row's token drawn as the sampler draws it
        (`DecoderStack.decode_sampled`): `settings` the rows' `(temperature, top_k,
        top_p, min_p)` lists (engine/sampler.py's `row_settings`), `u` float64
        `[steps, rows]`, step s's uniform numbers, `history` the rows' penalties and
        tokens so far, `(repetition, presence, frequency, prompt_tokens,
        output_tokens)` (engine/decode_bursts.py's `penalty_history`)."""
        return self._burst("decode_sampled", input_ids, positions, kv_caches, plan, steps, stop_ids, max_seconds,
                           *settings, u, *history)

    def _burst(self, method: str, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               plan, steps: int, stop_ids: list[int], max_seconds: float, *sampling) -> list[list[int]] | None:
        if self.head_reason is not None or plan.last_layer is not None or self.refusal(plan) is not None:
            return None
        backend = plan.backends[self.last_spec][0]
        batch = plan.batch
        cos, sin = self.rotary.tables(batch.max_seq_len + steps - 1)
        flat = getattr(self.stack, method)(input_ids, positions, cos, sin, kv_caches, self._plans(plan),
                                           batch.slot_mapping.to(torch.int64), steps, batch.block_size, stop_ids,
                                           self._invariant[backend.name], max_seconds, *sampling)
        rows = input_ids.shape[0]
        return [flat[i:i + rows] for i in range(0, len(flat), rows)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 plan) -> torch.Tensor:
        """The model's forward: embedding, every layer and the final norm in one call."""
        plans = self._plans(plan)
        last_plan, rows = [], None
        if plan.last_layer is not None:
            rows = plan.last_layer.rows
            p = plan.last_layer.backends[self.last_spec][1]
            if p is not None:
                last_plan = [p.query_start_loc, p.seq_lens, p.context_lens, p.block_table]
        backend = plan.backends[self.last_spec][0]
        cos, sin = self.rotary.tables(plan.batch.max_seq_len)
        return self.stack.forward_tokens(input_ids, positions, cos, sin, kv_caches, plans,
                                         plan.batch.slot_mapping.to(torch.int64), rows, last_plan,
                                         self._invariant[backend.name])


def decoder_stack_for(model) -> tuple[CppDecoderStack | None, str | None]:
    """The model's C++ decoder stack, or None and why not."""
    why_not = decoder_stack_unavailable(model)
    if why_not is not None:
        return None, why_not
    return CppDecoderStack(model), None


SWITCH_ENV = "KVFORGE_DECODER_STACK"  # "off": keep the Python layer loop (for before/after figures)


def attach_decoder_stack(model, sharded: bool = False) -> None:
    """Give a just-loaded model its C++ decoder stack (`model.decoder_stack`), or
    record why not (`model.decoder_stack_reason`); `sharded`: the model is one
    rank's part (tensor or pipeline parallelism)."""
    import os

    switch = os.environ.get(SWITCH_ENV, "on")
    if switch not in ("on", "off"):
        raise ValueError(f"{SWITCH_ENV} must be 'on' or 'off', got {switch!r}")
    stack, why_not = None, None
    if switch == "off":
        why_not = f"{SWITCH_ENV}=off"
    elif sharded:
        why_not = "the model is one rank's shard (tensor or pipeline parallelism)"
    else:
        stack, why_not = decoder_stack_for(model)
    model.decoder_stack, model.decoder_stack_reason = stack, why_not
