"""Batched LoRA: one step's tokens, grouped into segments by adapter slot, get
their adapter's low-rank update added to a base layer's output.

For the tokens `t` of a segment whose slot is `s >= 0`:

    y[t] += (x[t] @ a[s].T) @ b[s]        # shrink to rank R, then expand

`a` is `[slots, R, in]` and `b` is `[slots, R, out]`, both in the model's dtype, with
the adapter's scale already folded into `b`. Segments are given by `seg_starts`
(int64, `[G + 1]`, from 0 to the token count) and `seg_slots` (int64, `[G]`); a
segment of slot -1 (the base model) is left untouched, so a step whose tokens
are all of the base model does no work.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """`y += lora(x)` in place, segment by segment (see the module docstring)."""
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        lo, hi = starts[g], starts[g + 1]
        shrunk = x[lo:hi].float() @ a[slot].float().t()
        y[lo:hi] = (y[lo:hi].float() + shrunk @ b[slot].float()).to(y.dtype)  # one rounding
