"""bfloat16 and float32 linear layers through kvforge's C++ kernels, for CPU inference.

`torch.ops.kvforge_cpp.bf16_linear` (kernels/linear.cpp) reads the weight in a
layout packed once at load: sixteen output channels side by side for each pair
of inputs, the operand AVX-512 BF16's `vdpbf16ps` multiplies and sums in one
instruction (with float32 sums). CPUs without that instruction run the same
layout through AVX-512, AVX2 or plain float32 tiles, chosen at run time.
`torch.ops.kvforge_cpp.f32_linear` is its float32 twin (same tile driver and
epilogue): sixteen channels side by side for each input, one FMA operand. The
sums stay in float32 until one rounding at the end, after the epilogue the
models need: a bias, a residual add, or SiLU(gate) x up.

`use_cpp_linears(model)` swaps every `nn.Linear` (and GPT-2's `Conv1D`) of a
loaded bfloat16 or float32 CPU model for a `CppLinear`; a Llama-style MLP whose gate and
up projections feed SiLU gets one `CppGateUp` for both (one GEMM, no pass
outside it) unless LoRA wraps them (see `use_cpp_linears`); the language-model
head becomes a `CppLinear` that writes float32 logits directly. When
`linear_kernel` "auto" picks these kernels, and the measurements behind that:
docs/models.md, "bfloat16 linear layers" (float32 too) and its "float32
linear layers".

The packed copy replaces the weight: nothing keeps the original.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core import cdiv, dtype_name
from kvforge.core.errors import UnsupportedConfigurationError

from .heap import release_free_memory
from .huge_pages import move_onto_huge_pages
from .packed_linear import linear_weight, replace_linears
from .quantized_linear import fuse_int8_gate_up

LANES = 16  # output channels per packed block
DTYPES = (torch.bfloat16, torch.float32)  # what the kernels run


def load_kernel() -> None:
    """Build (once, cached on disk) and load kvforge's C++ library, or raise a clear error."""
    from kvforge.kernels import build

    try:
        build.load()
    except build.CppBuildError as exc:
        raise UnsupportedConfigurationError(
            f"linear kernel 'cpp' needs kvforge's C++ library, which did not build: {exc}; "
            "fix the toolchain, or use linear_kernel 'torch' or 'onednn'") from exc


def cpp_kernels_unavailable(kernels: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why kvforge's C++ `kernels` (named so in the message: the linear, or RMSNorm and
    rotary) cannot serve a `dtype` model on `device`; None when they can."""
    if device.type != "cpu":
        return f"the C++ {kernels} kernels are for CPU models, this one is on {device.type}"
    if dtype not in DTYPES:
        return f"the C++ {kernels} kernels run bfloat16 and float32 models, this one is {dtype_name(dtype)}"
    from kvforge.kernels import build

    if build.missing_tools() is not None and build.cached_library() is None:
        return f"kvforge's C++ library cannot be built here: {build.missing_tools()}"
    return None


def cpp_linear_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the C++ linear kernels cannot serve a `dtype` model on `device`; None when they can."""
    return cpp_kernels_unavailable("linear", dtype, device)


PAYS_ON = {torch.bfloat16: ("avx512_bf16", "avx2"), torch.float32: ("avx512_bf16", "avx512", "avx2")}
"""The kernel paths on which linear_kernel "auto" takes these kernels, per dtype (`cpp_linear_pays`)."""


def cpp_linear_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear_kernel "auto" picks these kernels for a `dtype` CPU model.

    bfloat16: on a CPU with AVX-512 BF16, where the kernel measured faster than
    `F.linear` and oneDNN at the bench models' layer shapes up to 32 rows and
    level at hundreds, and on AVX2, where oneDNN has no bfloat16 path and the
    kernel measured 2-8x `F.linear` at 1-512 rows. float32: on a CPU with
    AVX-512, where it measured 1.05-2.4x faster than both at 1-32 rows
    (decode), level at 64-512 and a few percent behind oneDNN at 2,048, and on
    AVX2, 1.5-2x oneDNN at 1-32 rows and 0.94-1.3x at 128-512. A model holds
    one packed copy of a weight, so the choice is per model, not per call.
    Tables: docs/models.md, "bfloat16 linear layers" (float32 too) and its
    "float32 linear layers"."""
    if cpp_linear_unavailable(dtype, device) is not None:
        return False
    try:
        path = kernel_path()
    except UnsupportedConfigurationError:  # the library did not build: auto takes torch or oneDNN (the loader logs why)
        return False
    return path in PAYS_ON[dtype]


def kernel_path() -> str:
    """The instruction set the kernel runs with here ("avx512_bf16", "avx512", "avx2" or "baseline")."""
    load_kernel()
    return torch.ops.kvforge_cpp.bf16_linear_path()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` as the kernel of its dtype reads it, out padded with zero
    channels to a multiple of 16: float32 `[blocks, in, 16]`; bfloat16 (any other
    dtype is rounded to it) `[blocks, pairs, 16, 2]`, in padded with a zero input
    to an even count (the kernel never reads past a row of x for it)."""
    out_features, in_features = weight.shape
    blocks = cdiv(out_features, LANES)
    if weight.dtype == torch.float32:
        padded = _padded(weight, blocks * LANES, in_features)
        return padded.view(-1, LANES, in_features).transpose(1, 2).contiguous()
    pairs = cdiv(in_features, 2)
    padded = _padded(weight.to(torch.bfloat16), blocks * LANES, pairs * 2)
    return padded.view(blocks, LANES, pairs, 2).transpose(1, 2).contiguous()


def _padded(weight: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """`weight` padded with zeros to `[rows, columns]`; itself where it has that shape
    (no copy beside the packed one: a vocabulary-sized head is the largest weight)."""
    if tuple(weight.shape) == (rows, columns):
        return weight.detach()
    padded = torch.zeros(rows, columns, dtype=weight.dtype, device=weight.device)
    padded[:weight.shape[0], :weight.shape[1]] = weight.detach()
    return padded


def pack_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """`bias` as float32, padded with zeros to whole blocks (the order of `pack_weight`)."""
    if bias is None:
        return None
    padded = torch.zeros(cdiv(out_features, LANES) * LANES, dtype=torch.float32, device=bias.device)
    padded[:out_features] = bias.detach().float()
    return padded


def interleave_blocks(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Blocks of two packed tensors alternating (first's 0, second's 0, first's 1, ...)."""
    return torch.stack([first, second], dim=1).flatten(0, 1).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, epilogue: str,
           other: torch.Tensor | None, float_out: bool = False) -> torch.Tensor:
    """The C++ linear op of `packed`'s dtype on 2-D `x` (float32 output is implied for float32)."""
    if packed.dtype == torch.float32:
        return torch.ops.kvforge_cpp.f32_linear(x, packed, out_features, bias, epilogue, other)
    return torch.ops.kvforge_cpp.bf16_linear(x, packed, out_features, bias, epilogue, other, float_out)


class CppLinear(nn.Module):
    """`y = x W^T + b` in the weight's dtype (bfloat16 or float32) through
    `kvforge_cpp::bf16_linear` or `f32_linear`, with `W` packed (`pack_weight`).
    `float_out` makes a bfloat16 layer's output float32 (the logits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False):
        super().__init__()
        load_kernel()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight)
        self.bias = pack_bias(bias, self.out_features)
        self.float_out = float_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x, "none", None)

    def binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """`(x W^T + b) op other` for op "add" (in the kernel's epilogue) or "mul"."""
        if op == "mul":
            return self(x).mul_(other)
        return self.call(x, op, other)

    def call(self, x: torch.Tensor, epilogue: str, other: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return linear(x, self.packed, self.out_features, self.bias, epilogue, other, self.float_out)
        rows = x.reshape(-1, self.in_features)
        other = None if other is None else other.reshape(-1, self.out_features)
        y = linear(rows, self.packed, self.out_features, self.bias, epilogue, other, self.float_out)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kvforge C++ {dtype_name(self.packed.dtype)}{', float32 out' if self.float_out else ''}")


class CppGateUp(nn.Module):
    """`silu(x G^T + bg) * (x U^T + bu)`, a SwiGLU MLP's gate and up projections as
    one GEMM: their packed blocks alternate, and the kernel's epilogue multiplies
    each gate block's SiLU with the up block beside it."""

    def __init__(self, gate: nn.Module, up: nn.Module):
        super().__init__()
        load_kernel()
        (gate_w, gate_b), (up_w, up_b) = linear_weight(gate), linear_weight(up)
        if gate_w.shape != up_w.shape:
            raise ValueError(f"gate and up weights must have one shape, got {tuple(gate_w.shape)} and "
                             f"{tuple(up_w.shape)}")
        self.out_features, self.in_features = gate_w.shape
        self.packed = interleave_blocks(pack_weight(gate_w), pack_weight(up_w))
        if gate_b is None and up_b is None:
            self.bias = None
        else:
            zeros = torch.zeros(self.out_features, device=gate_w.device)
            gb = pack_bias(gate_b if gate_b is not None else zeros, self.out_features)
            ub = pack_bias(up_b if up_b is not None else zeros, self.out_features)
            self.bias = torch.stack([gb.view(-1, LANES), ub.view(-1, LANES)], dim=1).flatten().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = linear(rows, self.packed, self.out_features, self.bias, "silu_mul", None)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"silu(gate) * up, kvforge C++ {dtype_name(self.packed.dtype)}")


FUSED_ACTIVATIONS = ("silu", "swish")  # what CppGateUp's epilogue computes


@torch.no_grad()
def use_cpp_linears(model: nn.Module) -> int:
    """Replace the linear layers of a loaded bfloat16 or float32 CPU model by CppLinear, fuse
    each SiLU MLP's gate and up into a CppGateUp (set as the MLP's `gate_up_proj`;
    an int8 pair that `quantize_linears` made into an Int8GateUp),
    and give the model a float32-output head (`lm_head_layer`); the number of
    weights packed. The packed weights then sit side by side on 2 MiB pages in
    the order the model runs them (`huge_pages`); fused int8 weights are new
    tensors, which `load_model` places once this is done (`place_on_huge_pages`)."""
    mlps = [m for m in model.modules()
            if hasattr(m, "gate_up_proj") and getattr(m, "act", None) in FUSED_ACTIVATIONS]
    for module in mlps:
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        # A LoRA layer (lora_layers.LoRALinear, for which linear_weight is None) is not fused: its
        # adapter's update must land on gate and up before SiLU and the product, which CppGateUp
        # computes inside its one kernel. The wrapper keeps its own CppLinear, the post-ops in torch.
        if linear_weight(gate) is not None and linear_weight(up) is not None:
            module.gate_up_proj = CppGateUp(gate, up)
        else:  # quantized weights (quantize_linears came first): the int8 kernel's epilogue does the same
            module.gate_up_proj = fuse_int8_gate_up(gate, up, model.dtype)
            if module.gate_up_proj is None:
                continue
        del module.gate_proj, module.up_proj, gate, up  # (`mlps` holds the MLPs only: the float weights go now)
        release_free_memory()
    head = model.lm_head_weight() if hasattr(model, "lm_head_weight") else None
    head_layer = CppLinear(head, None, float_out=True) if head is not None else None

    def packed_or_head(layer: nn.Module) -> nn.Module:
        if head_layer is not None and isinstance(layer, nn.Linear) and layer.weight is head:
            return head_layer  # an untied head: the one packed copy serves both
        return CppLinear(*linear_weight(layer))

    replace_linears(model, packed_or_head)
    del head
    if head_layer is not None:
        model.lm_head_layer = head_layer
    packed_layers = [m for m in model.modules() if isinstance(m, (CppLinear, CppGateUp))]  # the head once
    move_onto_huge_pages(packed_layers, "packed")
    return sum(2 if isinstance(m, CppGateUp) else 1 for m in packed_layers)
