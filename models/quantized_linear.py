"""Linear layers with int8 weights (`quantization.weights = NAME`), for memory and speed.

`quantize_linears(model, quantizer)` quantizes every linear weight of a loaded
model once, through a `Quantizer` reached by name in the registry (built-in:
`int8_weight`): int8 data and one float32 scale per output channel, the float
weight dropped. An untied language-model head is quantized too, since on a
small-hidden, large-vocabulary model it is the largest weight a decode step
reads; embeddings (and so a tied head) stay float, since a lookup reads one row.

`activations` picks the kernel: "none" (weight-only, the default) keeps the
weight packed for the C++ kernel (64 channels of one input side by side) and
widens it inside the kernel's register tiles; "int8" (W8A8, CPU only)
rounds each row to int8 with its own scale, so a row never depends on the rest
of the batch. Without the C++ library W8A8 runs the same arithmetic as torch
ops; on other devices weight-only widens the weight inside `F.linear`. With
the C++ kernels a residual add (`Int8Linear.binary`, what
`packed_linear.linear_add` calls) and a SwiGLU MLP's gate and up projections
(`Int8GateUp`, fused by `cpp_linear.use_cpp_linears`) run in the kernel's
epilogue; elsewhere the post-ops are separate in-place torch ops. Which
kernel wins where, and why: docs/models.md, "Quantized weights".
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core import PER_CHANNEL, Quantizer, dtype_name
from kvforge.core.errors import UnsupportedConfigurationError

from .huge_pages import move_onto_huge_pages
from .packed_linear import linear_weight, replace_linears

log = logging.getLogger(__name__)
_warned: set[str] = set()  # build failures already logged

# What the int8 layer reads: int8 data with one scale per output channel (row of `[out, in]`).
INT8_LINEAR_GRANULARITY = PER_CHANNEL
INT8_LINEAR_STORAGE = torch.int8
INT8_MAX = 127.0
TINY = torch.finfo(torch.float32).tiny
# What `activations` may be: "none" keeps them float (weight-only), "int8" quantizes each row (W8A8, CPU).
ACTIVATIONS = ("none", "int8")
# The C++ kernels' input dtypes; float16 rows are widened to float32 around the
# weight-only one and take W8A8's torch path.
CPP_DTYPES = (torch.float32, torch.bfloat16)


def load_weight_only_kernel() -> None:
    """Build (once, cached on disk) and load the library that holds
    `torch.ops.kvforge_cpp.int8_weight_linear`, or raise a clear error.

    The kernel is in kvforge's one compiled library (`kvforge.kernels`), which
    the cpp attention backend loads too."""
    from kvforge.kernels import build

    try:
        build.load()
    except build.CppBuildError as exc:
        raise UnsupportedConfigurationError(
            f"int8 weight-only linear layers on CPU need kvforge's C++ library, which did not build: {exc}; "
            "fix the toolchain, or set quantization.activations = 'int8' (W8A8, which runs through torch ops "
            "without the library)") from exc


def int8_linear_unsupported(quantizer: type[Quantizer] | Quantizer) -> str | None:
    """Why `Int8Linear` cannot run weights quantized by `quantizer`; None when it can.
    It needs `granularity == "per_channel"` and `storage_dtype == torch.int8`."""
    found = []
    if quantizer.granularity != INT8_LINEAR_GRANULARITY:
        found.append(f"granularity {quantizer.granularity!r}")
    if quantizer.storage_dtype != INT8_LINEAR_STORAGE:
        found.append(f"storage {dtype_name(quantizer.storage_dtype)}")
    if not found:
        return None
    return (f"quantizer {quantizer.name!r} has {' and '.join(found)}, but int8 linear layers need "
            f"granularity {INT8_LINEAR_GRANULARITY!r} (one scale per output channel) and int8 storage")


def load_w8a8_kernel() -> bool:
    """Whether `torch.ops.kvforge_cpp.int8_dynamic_linear` is there (building the
    library once if needed); when the build fails, W8A8 runs as torch ops, slower."""
    from kvforge.kernels import build

    try:
        build.load()
    except build.CppBuildError as exc:
        if str(exc) not in _warned:  # once, not once per layer
            _warned.add(str(exc))
            log.warning("W8A8 linears run as torch ops (slower): %s", exc)
        return False
    return True


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row of a 2-D `x` with its own absmax scale:
    `(q int8 [M, K], scale float32 [M, 1])`, `x ≈ q * scale`, |error| <= scale / 2."""
    x = x.float()
    # A zero row keeps a positive scale (and quantizes to zeros), never a division by zero.
    scale = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).div_(INT8_MAX).clamp_min_(TINY)
    return torch.div(x, scale).round_().to(torch.int8), scale


def int8_matmul(q: torch.Tensor, weight_int8: torch.Tensor) -> torch.Tensor:
    """`q @ weight_int8^T` as exact int32 sums. `torch._int_mm` on CPU returns wrong
    sums for one input feature (torch 2.13), so that case is an outer product."""
    if q.shape[1] == 1:
        return q.int() * weight_int8.t().int()
    return torch._int_mm(q, weight_int8.t())


def int8_gemm_in_torch(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 as torch ops: `(q_x @ w_int8^T) * s_x * s_w + b` in float32, then x's
    dtype (one rounding, after the bias), as `int8_dynamic_linear` computes it."""
    q, x_scale = quantize_rows(x)
    out = torch.mul(int8_matmul(q, weight_int8), x_scale).mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class Int8Linear(nn.Module):
    """`y = x W^T + b` with `W = weight_int8 * weight_scale[:, None]` held as int8.

    Buffers: `weight_int8`, the int8 weight in the layout its kernel reads:
    `[out, in]`, or on CPU with weight-only activations, when `out` is a multiple
    of 64 (no padding), packed by `kvforge_cpp::int8_pack_weight` (`[out / 64, in,
    64]`, 64 channels of one input side by side: kernels/int8_packed_linear.cpp),
    once, here; `int8_rows()` gives `[out, in]` either way. `weight_scale` float32 `[out]`, `bias` (model
    dtype) or None. `activations` "none" keeps the input float
    (weight-only), "int8" quantizes each input row too (W8A8, CPU only). See
    the module docstring for the kernels."""

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: str = "none"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activations!r}")
        if activations == "int8" and not weight_int8.is_cpu:
            raise UnsupportedConfigurationError(
                f"int8 activations (W8A8) run on CPU only, these weights are on {weight_int8.device.type}; "
                "use activations 'none' (weight-only) there")
        self.activations = activations
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError(
                f"weight_int8 must be a 2-D int8 tensor, got {weight_int8.dtype} {tuple(weight_int8.shape)}")
        self.out_features, self.in_features = weight_int8.shape
        if weight_scale.numel() != self.out_features:
            raise ValueError(f"weight_scale must hold one scale per output channel ({self.out_features}), "
                             f"got shape {tuple(weight_scale.shape)}")
        weight_int8 = weight_int8.detach().contiguous()
        if activations == "none" and weight_int8.is_cpu:
            load_weight_only_kernel()
            packed = torch.ops.kvforge_cpp.int8_pack_weight(weight_int8)  # the layout the kernel streams
            if packed.numel() == weight_int8.numel():  # no padded channels: out is whole blocks
                weight_int8 = packed
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale.detach().reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.fused_w8a8 = activations == "int8" and load_w8a8_kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:
            gemm = self._widened_gemm
        else:
            gemm = self._weight_only_gemm if self.activations == "none" else self._int8_gemm
        if x.dim() == 2:  # the models' `[tokens, features]`: no reshapes on the hot path
            return gemm(x)
        return gemm(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """`(x W^T + b) op other` for op "add" (in the C++ kernel's epilogue where it
        runs, one rounding: what `packed_linear.linear_add` calls) or "mul"."""
        if op == "add" and x.is_cpu and self.runs_epilogues(x.dtype):
            rows = x.reshape(-1, self.in_features)
            y = self.call(rows, "add", other.reshape(-1, self.out_features).contiguous())
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        y = self(x)
        return y.mul_(other) if op == "mul" else y.add_(other)

    def runs_epilogues(self, dtype: torch.dtype) -> bool:
        """Whether `call` runs on CPU inputs of `dtype`: float32 or bfloat16, weights on
        the CPU and a C++ kernel for them."""
        return (self.weight_int8.is_cpu and dtype in CPP_DTYPES
                and (self.activations == "none" or self.fused_w8a8))

    def call(self, x: torch.Tensor, epilogue: str, other: torch.Tensor | None) -> torch.Tensor:
        """The C++ op on 2-D CPU `x` (`runs_epilogues`) with its `epilogue` ("none", "add"
        with `other`, or "silu_mul": kernels/linear.cpp's epilogues)."""
        op = (torch.ops.kvforge_cpp.int8_weight_linear.default if self.activations == "none"
              else torch.ops.kvforge_cpp.int8_dynamic_linear.default)
        return op(x, self.weight_int8, self.weight_scale, self.bias, epilogue, other)

    # The ops' overloads themselves (`.default`): calling the overload packet costs a resolution per call.
    def _weight_only_gemm(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.kvforge_cpp.int8_weight_linear.default
        if x.dtype in CPP_DTYPES:
            return op(x, self.weight_int8, self.weight_scale, self.bias)
        return op(x.float(), self.weight_int8, self.weight_scale, self.bias).to(x.dtype)

    def _int8_gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_w8a8 and x.dtype in CPP_DTYPES:
            return torch.ops.kvforge_cpp.int8_dynamic_linear.default(x, self.weight_int8, self.weight_scale, self.bias)
        return int8_gemm_in_torch(x, self.weight_int8, self.weight_scale, self.bias)

    def _widened_gemm(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.int8_rows().to(x.dtype)).mul_(self.weight_scale.to(x.dtype))
        return out if self.bias is None else out.add_(self.bias)

    def int8_rows(self) -> torch.Tensor:
        """The int8 weight as `[out, in]`, whichever layout `weight_int8` holds (a copy when packed)."""
        if self.weight_int8.dim() == 2:
            return self.weight_int8
        return torch.ops.kvforge_cpp.int8_unpack_weight(self.weight_int8, self.out_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`weight_int8 * weight_scale` as a float `[out, in]` tensor (for checks, never the hot path)."""
        return (self.int8_rows().to(dtype) * self.weight_scale.to(dtype)[:, None])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 weights, activations={self.activations}")


GATE_UP_BLOCK = 16  # channels of gate, then of up, alternating in Int8GateUp's weight (linear.cpp's epilogue)


def alternate_blocks(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows (output channels) of two `[out, ...]` tensors alternating in blocks of
    `GATE_UP_BLOCK`: gate's first, up's first, gate's second, ..."""
    rest = gate.shape[1:]
    blocks = [t.reshape(-1, GATE_UP_BLOCK, *rest) for t in (gate, up)]
    return torch.stack(blocks, dim=1).reshape(-1, *rest).contiguous()


class Int8GateUp(nn.Module):
    """`silu(x G^T + bg) * (x U^T + bu)` with int8 G and U: a SwiGLU MLP's gate and up
    projections as one int8 linear (`both`), whose rows alternate blocks of 16 gate
    and 16 up channels, and whose kernel's epilogue multiplies each gate block's SiLU
    with the up block beside it: one call, no pass outside it. Built from two
    Int8Linear of one shape (`fuse_int8_gate_up`); the quantized values and scales
    are theirs."""

    def __init__(self, gate: Int8Linear, up: Int8Linear):
        super().__init__()
        self.out_features, self.in_features = gate.out_features, gate.in_features
        bias = None
        if gate.bias is not None or up.bias is not None:
            zeros = torch.zeros(self.out_features, dtype=torch.float32)
            bias = alternate_blocks(zeros if gate.bias is None else gate.bias.float(),
                                    zeros if up.bias is None else up.bias.float())
        self.both = Int8Linear(alternate_blocks(gate.int8_rows(), up.int8_rows()),
                               alternate_blocks(gate.weight_scale, up.weight_scale), bias, gate.activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self.both.call(rows, "silu_mul", None)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, silu(gate) * up, int8 weights, "
                f"activations={self.both.activations}")


def fuse_int8_gate_up(gate: nn.Module, up: nn.Module, x_dtype: torch.dtype) -> Int8GateUp | None:
    """`Int8GateUp(gate, up)` where its kernel serves them: two CPU Int8Linear of one
    shape and kind whose outputs are whole blocks of 16, for `x_dtype` inputs with a
    C++ kernel (`Int8Linear.runs_epilogues`); None otherwise (they stay two layers)."""
    if type(gate) is not Int8Linear or type(up) is not Int8Linear or not gate.runs_epilogues(x_dtype):
        return None
    if ((gate.out_features, gate.in_features, gate.activations) != (up.out_features, up.in_features, up.activations)
            or gate.out_features % GATE_UP_BLOCK):
        return None
    return Int8GateUp(gate, up)


def int8_linear(module: nn.Module, quantizer: Quantizer, activations: str = "none") -> Int8Linear | None:
    """`module` quantized by `quantizer` as an Int8Linear, if it is a float linear layer."""
    found = linear_weight(module)
    if found is None:
        return None
    weight, bias = found
    data, scale = _quantized_rows(quantizer, weight.detach())
    return Int8Linear(data, scale, bias, activations)


QUANTIZE_ROWS_BYTES = 8 * 2**20
"""The float rows `int8_linear` quantizes at a time: a per_channel scale depends on
its row alone, so a vocabulary-sized head is quantized in parts, and the
quantizer's float temporaries stay this small."""


def _quantized_rows(quantizer: Quantizer, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` quantized by the per_channel `quantizer`, `QUANTIZE_ROWS_BYTES`
    of rows at a time: the int8 data `[out, in]` and the scales `[out, 1]`."""
    out_features = weight.shape[0]
    step = max(1, QUANTIZE_ROWS_BYTES // max(1, weight[0].nbytes))
    parts = []
    for start in range(0, out_features, step):
        rows = weight[start:start + step]
        part = quantizer.quantize(rows)
        if part.data.shape != rows.shape or part.scale.numel() != rows.shape[0]:
            raise UnsupportedConfigurationError(
                f"quantizer {quantizer.name!r} returned data {tuple(part.data.shape)} and scale "
                f"{tuple(part.scale.shape)} for a {tuple(rows.shape)} weight; a per_channel quantizer must give "
                f"data of the weight's shape and one scale per output channel ({rows.shape[0]}, 1)")
        parts.append((part.data, part.scale.reshape(-1, 1)))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([d for d, _ in parts]), torch.cat([s for _, s in parts])


def check_int8_linears(quantizer: Quantizer, activations: str) -> None:
    """Raise UnsupportedConfigurationError, with the choices, unless Int8Linear layers
    can be made with `quantizer` and run with `activations`."""
    if activations not in ACTIVATIONS:
        raise UnsupportedConfigurationError(
            f"activations {activations!r} is not a choice: use 'none' (weight-only, int8 weights and float "
            "activations) or 'int8' (W8A8: each activation row quantized too, CPU only)")
    reason = int8_linear_unsupported(quantizer)
    if reason is not None:
        raise UnsupportedConfigurationError(f"{reason}; use 'int8_weight' or another per_channel int8 quantizer")


@torch.no_grad()
def quantize_linears(model: nn.Module, quantizer: Quantizer, lm_head: bool = True, activations: str = "none",
                     place: bool = True) -> int:
    """Replace every float linear layer of a loaded model by an Int8Linear quantized
    with `quantizer` and running with `activations` (see Int8Linear); the number
    replaced. An untied language-model head is among them unless `lm_head` is
    False (it then becomes the model's `lm_head_layer`); a tied head is the
    embedding and stays float. Call it after `finish_loading` (fused q/k/v are
    quantized as one weight). With `place`, on a CPU the int8 weights then sit
    side by side on 2 MiB pages (`place_on_huge_pages`; a caller that changes
    them further, as `load_model` does, places them once it is done)."""
    check_int8_linears(quantizer, activations)
    count = replace_linears(model, int8_replacement(model, quantizer, lm_head, activations))
    if place:
        place_on_huge_pages([m for m in model.modules() if isinstance(m, Int8Linear)])
    return count


def int8_replacement(model: nn.Module, quantizer: Quantizer, lm_head: bool, activations: str):
    """`quantize_linears`' replacement of one float linear layer of `model`: its
    Int8Linear, or None for a head `lm_head` leaves in float; a quantized head
    also becomes `model.lm_head_layer`."""

    def quantized(layer: nn.Module) -> Int8Linear | None:
        head = model.lm_head_weight() if hasattr(model, "lm_head_weight") else None
        is_head = head is not None and getattr(layer, "weight", None) is head
        del head  # no reference to the float head outlives its replacement
        if is_head and not lm_head:
            return None
        replacement = int8_linear(layer, quantizer, activations)
        if is_head:
            model.lm_head_layer = replacement
        return replacement

    return quantized


def place_on_huge_pages(layers: list[Int8Linear]) -> None:
    """Move the int8 weights of `layers` side by side onto 2 MiB pages (on a CPU;
    `huge_pages`), in order: a decode step then streams them as one run of pages.
    Weights already side by side in one mapping stay. Weights on such pages that
    move to a new mapping free the old one only when its last weight has moved:
    place them once, when they are final."""
    if not _placed(layers):
        move_onto_huge_pages(layers, "weight_int8")


def _placed(layers: list[Int8Linear]) -> bool:
    """Whether the int8 weights of `layers` are views of one mapping, in order."""
    weights = [layer.weight_int8 for layer in layers]  # (freed on return: the move frees each as it goes)
    return len(weights) > 1 and len({w.untyped_storage().data_ptr() for w in weights}) == 1 and \
        all(a.data_ptr() < b.data_ptr() for a, b in zip(weights, weights[1:]))
