"""Triton kernels of the batched LoRA op for CUDA tensors (Punica's SGMV):
`y[t] += (x[t] @ a[s].T) @ b[s]` for the tokens of each segment of slot `s >= 0`
(the contract: `kvforge.kernels.lora_ops`).

* `lora_shrink_kernel`: one program per (segment, tile of its tokens, tile of
  ranks) writes `x @ a[s].T` into a float32 buffer `[T, R]`.
* `lora_expand_kernel`: one program per (segment, tile of its tokens, tile of
  output columns) adds `buffer @ b[s]` to `y`, rounded once to y's dtype.

A program reads its segment's bounds and slot itself; programs past the end of
a shorter segment, and every program of a slot -1 segment, mask all their loads
and stores (a device `seg_slots` is never read back to the host, so a slot out of
range is skipped the same way). Every load is masked and every index clamped:
under `TRITON_INTERPRET=1` an out-of-bounds access crashes the process instead
of raising.

bfloat16 shrink operands go to `tl.dot` as they are (exact products, float32
sums); float32 ones, the float32 buffer, and every operand under the
interpreter (whose bfloat16 dots are wrong) go as float32 with
`input_precision="ieee"` (no TF32 rounding). Importing this module imports triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens per program: tl.dot's smallest tile side
BLOCK_K = 64  # inputs per step of the shrink
BLOCK_R = 16  # ranks per shrink program, and per step of the expand
BLOCK_N = 64  # output columns per expand program


@triton.jit
def round_to_bf16(v):
    """float32 -> bfloat16, to nearest even with bit operations (as torch rounds;
    the interpreter's own conversion truncates). NaN stays a quiet NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _segment(starts_ptr, slots_ptr, num_slots, g):
    """Segment `g`'s slot (0 when it has none) and token span; an inactive segment
    (slot -1, or out of range) gets an empty span, so it reads and writes nothing."""
    slot = tl.load(slots_ptr + g)
    active = (slot >= 0) & (slot < num_slots)
    start = tl.load(starts_ptr + g)
    end = tl.where(active, tl.load(starts_ptr + g + 1), start)
    return tl.where(active, slot, 0).to(tl.int64), start, end


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, buf_ptr, starts_ptr, slots_ptr, num_slots, rank, k, stride_xt,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                       DOT_FP32: tl.constexpr):
    slot, start, end = _segment(starts_ptr, slots_ptr, num_slots, tl.program_id(0))
    tokens = start + tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_ok = tokens < end
    rank_ok = ranks < rank
    safe_tokens = tl.where(token_ok, tokens, 0).to(tl.int64)
    safe_ranks = tl.where(rank_ok, ranks, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        safe_cols = tl.where(col_ok, cols, 0)
        xs = tl.load(x_ptr + safe_tokens[:, None] * stride_xt + safe_cols[None, :],
                     mask=token_ok[:, None] & col_ok[None, :], other=0.0)
        a_t = tl.load(a_ptr + (slot * rank + safe_ranks[None, :]) * k + safe_cols[:, None],
                      mask=rank_ok[None, :] & col_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]: a[s] transposed
        if DOT_FP32:
            acc += tl.dot(xs.to(tl.float32), a_t.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xs, a_t)
    tl.store(buf_ptr + safe_tokens[:, None] * rank + safe_ranks[None, :], acc,
             mask=token_ok[:, None] & rank_ok[None, :])


@triton.jit
def lora_expand_kernel(buf_ptr, b_ptr, y_ptr, starts_ptr, slots_ptr, num_slots, rank, n, stride_yt,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       Y_BF16: tl.constexpr):
    slot, start, end = _segment(starts_ptr, slots_ptr, num_slots, tl.program_id(0))
    tokens = start + tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_ok = tokens < end
    col_ok = cols < n
    safe_tokens = tl.where(token_ok, tokens, 0).to(tl.int64)
    safe_cols = tl.where(col_ok, cols, 0)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        safe_ranks = tl.where(rank_ok, ranks, 0).to(tl.int64)
        s = tl.load(buf_ptr + safe_tokens[:, None] * rank + safe_ranks[None, :],
                    mask=token_ok[:, None] & rank_ok[None, :], other=0.0)
        bs = tl.load(b_ptr + (slot * rank + safe_ranks[:, None]) * n + safe_cols[None, :],
                     mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(s, bs.to(tl.float32), input_precision="ieee")
    where = y_ptr + safe_tokens[:, None] * stride_yt + safe_cols[None, :]
    mask = token_ok[:, None] & col_ok[None, :]
    y = tl.load(where, mask=mask, other=0.0)
    total = y.to(tl.float32) + acc
    if Y_BF16:
        tl.store(where, round_to_bf16(total), mask=mask)
    else:
        tl.store(where, total, mask=mask)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """`add_lora` for tensors on a CUDA device (or on the CPU under `TRITON_INTERPRET=1`)."""
    from .lora_ops import check_lora_args

    check_lora_args(y, x, a, b, seg_starts, seg_slots)
    tokens, k = x.shape
    slots, rank, n = b.shape
    segments = seg_slots.numel()
    lengths = seg_starts[1:] - seg_starts[:-1]
    longest = int(lengths.max()) if segments else 0
    if longest == 0 or rank == 0 or n == 0:
        return
    if y.stride(-1) != 1:
        raise ValueError(f"add_lora: y must have unit stride along its columns on {y.device}, got strides "
                         f"{tuple(y.stride())}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    starts = seg_starts.to(y.device, non_blocking=True)
    slots_here = seg_slots.to(y.device, non_blocking=True)
    buffer = torch.empty(tokens, rank, dtype=torch.float32, device=y.device)
    token_tiles = triton.cdiv(longest, BLOCK_T)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    lora_shrink_kernel[(segments, token_tiles, triton.cdiv(rank, BLOCK_R))](
        x, a, buffer, starts, slots_here, slots, rank, k, x.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, DOT_FP32=interpreted or x.dtype == torch.float32)
    lora_expand_kernel[(segments, token_tiles, triton.cdiv(n, BLOCK_N))](
        buffer, b, y, starts, slots_here, slots, rank, n, y.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, Y_BF16=y.dtype == torch.bfloat16)
