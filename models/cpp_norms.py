"""RMSNorm and rotary embeddings through kvforge's C++ kernels, for CPU models.

In torch, a bfloat16 RMSNorm is a float32 copy of the rows, five small ops and
a copy back, and a rotation four ops: about twenty dispatches and passes over
memory per layer that the bench's small models pay at every step
(docs/benchmarks.md, "bfloat16 round two"). `kvforge_cpp::rms_norm` and
`kvforge_cpp::rotary` (kernels/rms_norm_rotary.cpp) do each in one pass with
float32 math inside, rounding as the torch path does (RMSNorm: Hugging Face's
order) or once (rotary, from float32 tables). `linear_kernel` "cpp", and "auto"
for float32 and bfloat16 CPU models, switch a loaded model to them (measured
gains: docs/benchmarks.md, "bfloat16 round two").
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm, RotaryEmbedding
from .cpp_linear import cpp_kernels_unavailable, load_kernel


def cpp_norms_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the C++ RMSNorm and rotary kernels cannot serve a `dtype` model on `device`; None when they can."""
    return cpp_kernels_unavailable("RMSNorm and rotary", dtype, device)


def use_cpp_norms(model: nn.Module) -> int:
    """Switch every RMSNorm and rotary embedding of a CPU model to the C++ kernels;
    the number switched."""
    load_kernel()
    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.kernel = "cpp"
            count += 1
    return count
