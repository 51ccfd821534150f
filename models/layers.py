"""The layers every architecture builds from: RMSNorm, rotary position embeddings
(with their scaling rules), and the MLP activations by their config names. Each
matches the Hugging Face implementation's rounding order, and RMSNorm and the
rotary tables also run on kvforge's C++ kernels (`cpp_norms.use_cpp_norms`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.errors import ConfigError

from .base import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the Hugging Face models.

    `kernel` "cpp" (set by `cpp_norms.use_cpp_norms`) runs kvforge's C++ kernel:
    one pass, the same rounding order, no float32 copy of the rows."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpp":
            return torch.ops.kvforge_cpp.rms_norm(x, self.weight, self.eps)
        # Hugging Face's rounding order (normalise in float32, cast, then scale by the weight),
        # with the small ops and the last multiply in place: fewer tensors to allocate.
        # (`F.rms_norm` is no faster here: on CPU it decomposes into these same ops.)
        x32 = x.float()
        scale = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x32 * scale).to(x.dtype).mul_(self.weight)


ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(config: ModelConfig, head_size: int) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or Llama-3 scaling when the config asks.

    Reads both config spellings: `rope_parameters` (transformers 5) and
    `rope_theta` + `rope_scaling` (transformers 4)."""
    params = dict(config.value("rope_parameters", {}) or {})
    scaling = dict(config.value("rope_scaling", {}) or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.value("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = int(head_size * float(params.get("partial_rotary_factor", config.value("partial_rotary_factor", 1.0))))
    if dim != head_size:
        raise ConfigError(f"partial rotary embeddings (rotary dim {dim} of head size {head_size}) are not supported")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"rope type {kind!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the rotate-half layout of the Hugging Face models).

    `forward(positions)` gives the step's (cos, sin) once, `[T, 1, head/2]` in the
    model's dtype (both halves of a head share them); `rotate` uses them in every
    layer. With `kernel` "cpp" (set by `cpp_norms.use_cpp_norms`) they are float32
    `[T, head/2]` for kvforge's C++ rotation (one pass, one rounding): the positions'
    rows of `tables`, made once rather than every step."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.inv_freq = inv_freq  # a plain attribute, so meta-device construction leaves it real
        self.kernel = "torch"
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`limit` (kernel "cpp"): a bound on the positions (the step's longest
        sequence), so the rows come from `tables` without reading the positions."""
        if self.kernel == "cpp":
            if limit is None:
                limit = int(positions.max()) + 1 if positions.numel() else 0
            cos, sin = self.tables(limit)
            return cos.index_select(0, positions), sin.index_select(0, positions)
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angles[:, None, :].cos().to(dtype), angles[:, None, :].sin().to(dtype)

    def tables(self, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel's float32 cos and sin `[N, head/2]` of positions 0 .. N - 1,
        N >= `limit`: made once (grown by doubling) by the same elementwise float32 ops a
        step's positions alone would take, so a row is bitwise what those give."""
        if self._tables is None or self._tables[0].shape[0] < limit:
            size = max(limit, 2 * (0 if self._tables is None else self._tables[0].shape[0]), 256)
            angles = torch.arange(size).float()[:, None] * self.inv_freq.cpu()[None, :]
            self._tables = angles.cos(), angles.sin()
        return self._tables


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `x * cos + rotate_half(x) * sin` for `x` `[T, heads, head]` (any
    strides), written half by half into one new tensor: no negated or concatenated copies.
    The C++ kernel's float32 `[T, head/2]` tables (`RotaryEmbedding` with kernel "cpp")
    go to that kernel."""
    if cos.dim() == 2:
        return torch.ops.kvforge_cpp.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]
