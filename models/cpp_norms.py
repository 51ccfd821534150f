"""RMSNorm and rotary embeddings through kvforge's C++ kernels, for CPU models.

In torch, a bfloat16 RMSNorm is a float32 copy of the rows, five small ops and
a copy back, and a rotation four ops: about twenty dispatches and passes over
memory per layer that the bench's small models pay at every step
(docs/benchmarks.md, "bfloat16 round two"). `kvforge_cpp::rms_norm` and
`kvforge_cpp::rotary` (kernels/rms_norm_rotary.cpp) do each in one pass with
float32 math inside, rounding as the torch path does (RMSNorm: Hugging Face's
order) or once (rotary, from float32 tables).
"""

from __future__ import annotations

from torch import nn

from .base import RMSNorm, RotaryEmbedding
from .cpp_linear import load_kernel


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
