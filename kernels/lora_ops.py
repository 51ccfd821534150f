"""Batched LoRA: one step's tokens, grouped into segments by adapter slot, get
their adapter's low-rank update added to a base layer's output.

For the tokens `t` of a segment whose slot is `s >= 0`:

    y[t] += (x[t] @ a[s].T) @ b[s]        # shrink to rank R, then expand

`a` is `[slots, R, in]` and `b` is `[slots, R, out]`, both in the model's dtype, with
the adapter's scale already folded into `b`. Segments are given by `seg_starts`
(int64, `[G + 1]`, from 0 to the token count) and `seg_slots` (int64, `[G]`); a
segment of slot -1 (the base model) is left untouched, so a step whose tokens
are all of the base model does no work.

Sums are float32 on every path and `y` is rounded once, after the update is
added. `add_lora` runs, by `y`'s device (`lora_kernel_path` says which):

* CUDA: the Triton kernels of `lora_triton` (shrink and expand over segments).
* CPU: `kvforge_cpp::add_lora` (kernels/lora.cpp) once the C++ library is
  loaded (`kvforge.kernels.build.load`; this module never builds it), else
  `add_lora_torch`, two matmuls per segment.

`reference_lora` is the float64 result every path is tested against.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16)  # what the kernels run


def reference_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """`y + lora(x)` in float64, as a new tensor (`y` is not modified)."""
    out = y.double().cpu()
    x64, a64, b64 = x.double().cpu(), a.double().cpu(), b.double().cpu()
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            lo, hi = starts[g], starts[g + 1]
            out[lo:hi] += (x64[lo:hi] @ a64[slot].T) @ b64[slot]
    return out


def check_lora_args(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """Raise `ValueError` naming the argument when the shapes, dtypes or segments are
    not those of `add_lora` (the C++ op checks the same on its own)."""
    op = "add_lora: "
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in (y, a, b)):
        raise ValueError(f"{op}y, x, a and b must share one dtype, float32 or bfloat16 (the model's), got "
                         f"y {y.dtype}, x {x.dtype}, a {a.dtype}, b {b.dtype}")
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{op}x must be [tokens, in] and y [tokens, out] with the same tokens, got x "
                         f"{list(x.shape)}, y {list(y.shape)}")
    if a.dim() != 3 or list(a.shape[2:]) != [x.shape[1]]:
        raise ValueError(f"{op}a must be [slots, R, in] with in = {x.shape[1]} (x's features), got {list(a.shape)}")
    if b.dim() != 3 or list(b.shape) != [a.shape[0], a.shape[1], y.shape[1]]:
        raise ValueError(f"{op}b must be [slots, R, out] = {[a.shape[0], a.shape[1], y.shape[1]]} (slots and R "
                         f"of a, out of y), got {list(b.shape)}")
    if seg_starts.dtype != torch.int64 or seg_starts.dim() != 1 or seg_starts.numel() < 1 \
            or seg_starts.device.type != "cpu":
        raise ValueError(f"{op}seg_starts must be an int64 CPU vector [G + 1] (segment starts, then the token "
                         f"count), got {seg_starts.dtype} {list(seg_starts.shape)} on {seg_starts.device}")
    if seg_slots.dtype != torch.int64 or list(seg_slots.shape) != [seg_starts.numel() - 1]:
        raise ValueError(f"{op}seg_slots must be an int64 vector of one slot per segment ({seg_starts.numel() - 1}, "
                         f"one fewer than seg_starts), got {seg_slots.dtype} {list(seg_slots.shape)}")
    starts = seg_starts.tolist()
    if starts[0] != 0 or starts[-1] != x.shape[0]:
        raise ValueError(f"{op}seg_starts must run from 0 to the token count {x.shape[0]}, got "
                         f"{starts[0]} .. {starts[-1]}")
    if any(lo > hi for lo, hi in zip(starts, starts[1:])):
        raise ValueError(f"{op}seg_starts must not decrease, got {starts}")
    if seg_slots.device.type == "cpu":  # a device tensor is not read back (no sync); the kernel skips bad slots
        bad = [s for s in seg_slots.tolist() if not -1 <= s < a.shape[0]]
        if bad:
            raise ValueError(f"{op}seg_slots holds {bad[0]}: a slot must be -1 (the base model) or "
                             f"0 .. {a.shape[0] - 1} (a and b hold {a.shape[0]} slots)")


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """`add_lora` as torch ops: two float32 matmuls per active segment."""
    check_lora_args(y, x, a, b, seg_starts, seg_slots)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        lo, hi = starts[g], starts[g + 1]
        shrunk = x[lo:hi].float() @ a[slot].float().t()
        y[lo:hi] = (y[lo:hi].float() + shrunk @ b[slot].float()).to(y.dtype)  # one rounding


_loaded = False  # the C++ library, once seen loaded (it is never unloaded): add_lora runs per layer and step


def _cpp_loaded() -> bool:
    global _loaded
    if not _loaded:
        from kvforge.kernels import build

        _loaded = build.is_loaded()
    return _loaded


def lora_kernel_path(device: torch.device | str) -> str:
    """Which implementation `add_lora` runs for tensors on `device`: "triton"
    (CUDA), "cpp-avx512", "cpp-avx2" or "cpp-baseline" (the C++ op and the
    instruction set it runs with here, capped by KVFORGE_CPP_ISA), or "torch"."""
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and _cpp_loaded():
        return f"cpp-{torch.ops.kvforge_cpp.lora_path()}"
    return "torch"


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """`y += lora(x)` in place, segment by segment (see the module docstring)."""
    if y.device.type == "cuda":
        from . import lora_triton  # imports triton: only when a CUDA model runs LoRA

        lora_triton.add_lora_triton(y, x, a, b, seg_starts, seg_slots)
    elif y.device.type == "cpu" and y.stride(-1) == 1 and _cpp_loaded():
        x = x if x.stride(-1) == 1 else x.contiguous()
        torch.ops.kvforge_cpp.add_lora(y, x, a.contiguous(), b.contiguous(), seg_starts, seg_slots.cpu())
    else:
        add_lora_torch(y, x, a, b, seg_starts, seg_slots)
