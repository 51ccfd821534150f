"""Linear layers through oneDNN with weights packed once, for CPU inference.

`torch.nn.functional.linear` on a CPU re-reads the weight in its stored
row-major layout at every call. oneDNN can reorder the weight once into the
blocked layout its GEMM kernels stream, and then run each call on that copy,
faster than `F.linear` from a few rows up (figures: docs/models.md). `pack_linears(model)`
swaps every `nn.Linear` (and GPT-2's transposed `Conv1D`) of a loaded model
for a `PackedLinear`; the language-model head is packed too.

oneDNN also applies an activation, or a multiply or add with another tensor,
to the GEMM's output before writing it ("post-ops"), which saves the model a
pass over memory per fused op. The models reach these through `linear_act`,
`linear_mul` and `linear_add`, which fall back to plain torch for `nn.Linear`
and hand a LoRA layer (`lora_layers.LoRALinear`) its own routing.

The packed copy replaces the weight: nothing keeps the original.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import dtype_name

from .heap import release_free_memory
from .layers import activation

LINEAR_KERNELS = ("auto", "torch", "onednn", "cpp")
# "auto" packs a weight of at least this many elements: a packed call has a fixed
# cost before any work, which a small weight's GEMM does not earn back; from
# 512 x 512 packing wins from a few rows up (figures: docs/models.md).
AUTO_MIN_WEIGHT = 512 * 512
# Activations (Hugging Face names) that oneDNN applies inside the GEMM: its post-op and algorithm.
POST_OPS = {
    "silu": ("swish", ""),
    "swish": ("swish", ""),
    "relu": ("relu", ""),
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
}


def onednn_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why oneDNN-packed linears cannot serve `dtype` on `device`; None when they can."""
    if device.type != "cpu":
        return f"oneDNN packing is for CPU models, this one is on {device.type}"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return None
    return f"oneDNN has no fast {dtype_name(dtype)} kernels on this CPU"


class PackedLinear(nn.Module):
    """`y = x W^T + b` with `W` held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # The batch size hint only tunes the layout; the packed weight serves any row count.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor, post_op: str = "none", algorithm: str = "") -> torch.Tensor:
        """`x W^T + b`, then oneDNN's elementwise `post_op` (see `POST_OPS`) in the same pass."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, post_op, [], algorithm)

    def binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """`(x W^T + b) op other` for op "mul" or "add", `other` shaped like the output."""
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other.contiguous(), self.packed, self.bias, op)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


def linear_act(layer: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor:
    """`act(layer(x))` for an activation named as in `layers.ACTIVATIONS`; one GEMM when packed."""
    if getattr(layer, "routes_post_ops", False):  # lora_layers.LoRALinear: the adapter's update before `act`
        return layer.linear_act(x, act)
    if isinstance(layer, PackedLinear) and act in POST_OPS:
        return layer(x, *POST_OPS[act])
    return activation(act)(layer(x))


def linear_mul(layer: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`layer(x) * other`; one GEMM when packed."""
    if getattr(layer, "routes_post_ops", False):  # lora_layers.LoRALinear
        return layer.linear_mul(x, other)
    if isinstance(layer, PackedLinear):
        return layer.binary(x, other, "mul")
    return layer(x).mul_(other)  # products commute, so this rounds like `other * layer(x)`


def linear_add(layer: nn.Module, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """`layer(x) + other` (a residual), or `layer(x)` when `other` is None; one GEMM when packed."""
    if other is None:
        return layer(x)
    if getattr(layer, "routes_post_ops", False):  # lora_layers.LoRALinear
        return layer.linear_add(x, other)
    if hasattr(layer, "binary"):  # PackedLinear, or cpp_linear.CppLinear: the add in the GEMM's epilogue
        return layer.binary(x, other, "add")
    return layer(x).add_(other)


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The `[out, in]` weight and the bias of a float linear layer the models use
    (`nn.Linear`, GPT-2's `Conv1D`), or None for any other module."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if getattr(module, "weight_is_in_by_out", False):  # GPT-2's Conv1D: weight stored [in, out]
        return module.weight.t(), module.bias
    return None


def replace_linears(model: nn.Module, replacement) -> int:
    """Set each float linear layer of `model` (`linear_weight`) to
    `replacement(layer)` where that is not None; the number replaced. A parent's
    layers at a time, and after each parent the heap gives what its old layers
    held back to the OS (`heap.release_free_memory`): only the parents are held
    while walking, so each float weight is freed as it is replaced, and a model
    being packed or quantized is never held twice over. The parents go deepest
    first: the model's own children (a vocabulary-sized head, the largest weight,
    whose replacement needs the most temporary memory) come last, when the other
    float weights are gone."""
    count = 0
    parents = [(m, names) for m in model.modules()  # (the parents only: a walk holding the layers would keep them)
               if (names := [n for n, c in m.named_children() if linear_weight(c) is not None])]
    for parent, names in reversed(parents):
        for name in names:
            new = replacement(getattr(parent, name))
            if new is not None:
                setattr(parent, name, new)
                count += 1
        release_free_memory()
    return count


def packed(module: nn.Module, min_weight: int = 0) -> PackedLinear | None:
    """`module` as a PackedLinear, if it is a linear layer this module knows with
    a weight of at least `min_weight` elements."""
    found = linear_weight(module)
    if found is None or found[0].numel() < min_weight:
        return None
    return PackedLinear(*found)


@torch.no_grad()
def pack_linears(model: nn.Module, min_weight: int = 0) -> int:
    """Replace the linear layers of a loaded CPU model whose weight has at least
    `min_weight` elements by PackedLinear, and give it a packed language-model
    head (`lm_head_layer`, which `compute_logits` uses) on the same terms; the
    number of weights packed."""
    head = model.lm_head_weight() if hasattr(model, "lm_head_weight") else None
    head = head if head is not None and head.numel() >= min_weight else None
    head_layer = PackedLinear(head, None) if head is not None else None

    def packed_or_head(layer: nn.Module) -> nn.Module | None:
        if head_layer is not None and isinstance(layer, nn.Linear) and layer.weight is head:
            return head_layer  # an untied head: the one packed copy serves both
        return packed(layer, min_weight)

    replace_linears(model, packed_or_head)
    del head
    if head_layer is not None:
        model.lm_head_layer = head_layer
    return sum(isinstance(m, PackedLinear) for m in model.modules())  # the head once, tied or not
