"""Applying a bitmask to CPU logits by whichever of two exact ops is faster for it.

xgrammar's CPU kernel skips words whose 32 tokens are all allowed and walks the
bits of every other word, so its cost grows with the share of words that forbid
something; the torch op below unpacks every bit and selects in one pass, at a cost
that does not depend on the mask. Grammars mostly forbid almost everything (a JSON
grammar between tokens allows a handful), where the torch op wins several times
over; inside a string they allow almost everything, where the kernel wins by more.
Both set exactly the forbidden logits to -inf, so the choice changes no result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

KERNEL_MAX_FORBIDDING_WORDS = 1 / 3
"""The kernel runs when at most this share of the bitmask's words forbid a token:
its cost at that share, about a third of its cost on an all-forbidding mask, is
where it meets the torch op's flat cost."""
_SHIFTS = torch.arange(32, dtype=torch.int32)
_NEG_INF = torch.tensor(float("-inf"))


def apply_bitmask_where(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set to -inf every logit whose bit is clear: one unpack of the bits and one
    select written into the logits (a 2-D CPU `logits` at most 32 * words wide)."""
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(-2)[:, :vocab]
    if rows is None:
        torch.where(allowed, logits, _NEG_INF, out=logits)
        return
    index = torch.as_tensor(list(rows), dtype=torch.long)
    logits[index] = torch.where(allowed, logits[index], _NEG_INF)


def forbidding_share(bitmask: torch.Tensor) -> float:
    """The share of the bitmask's words with at least one token forbidden."""
    return int(torch.count_nonzero(bitmask != -1)) / max(bitmask.numel(), 1)


def apply_bitmask_fastest(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None,
                          kernel: Callable[[torch.Tensor, torch.Tensor, Sequence[int] | None], None]) -> None:
    """`kernel` (the library's, same arguments) on a mask that forbids little, the
    torch op otherwise."""
    if forbidding_share(bitmask) <= KERNEL_MAX_FORBIDDING_WORDS:
        kernel(logits, bitmask, rows)
    else:
        apply_bitmask_where(logits, bitmask, rows)
