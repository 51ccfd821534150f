"""Inputs for the `quantizer` checks, shaped by the quantizer's granularity, and
the round-trip bound they are judged by.

The scale group of an element is what one scale covers: a row of the last
dimension for `per_token` (KV-shaped `[tokens, kv_heads, head_size]` inputs) and
`per_channel` (2-D `[out, in]` weights), the whole tensor for `per_tensor`.
Guarantee 1 of `kvforge.core.Quantizer` bounds the round-trip error of each
element by `error_bound` times the largest magnitude in its group; everything is
compared in float64 against the input as given (a bfloat16 input is judged
against its bfloat16 values, so only the quantizer's error counts).

Every check draws a fresh seed (`KVFORGE_CONFORMANCE_SEED` pins it, as for the
attention checks) and every failure message names it.
"""

from __future__ import annotations

import torch

from kvforge.conformance.selection import quick
from kvforge.core import PER_CHANNEL, PER_TENSOR, PER_TOKEN, QuantizedTensor, Quantizer, dtype_name

INPUT_DTYPES = (torch.float32, torch.bfloat16)

_SHAPES = {
    PER_TOKEN: [(5, 2, 16), (1, 1, 1), (17, 4, 64)],  # [tokens, kv_heads, head_size]
    PER_CHANNEL: [(8, 24), (1, 1), (32, 96)],  # [out, in]
    PER_TENSOR: [(6, 10), (1,), (3, 4, 16)],
}


def shapes(quantizer: Quantizer) -> list[tuple[int, ...]]:
    """Input shapes for the quantizer's granularity; the first alone on the quick grid."""
    found = _SHAPES[quantizer.granularity]
    return found[:1] if quick() else found


def kv_capable(quantizer: Quantizer) -> bool:
    """Whether `cache.kv_cache_dtype` may name it: the KV cache layout keeps one
    scale per (token, KV head), which a `per_token` quantizer produces and a
    static-scale one fills with its constant (`Quantizer.kv_capable`)."""
    return quantizer.kv_capable()


def expected_back(quantizer: Quantizer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the round trip should give back, float64; the magnitude each element's
    error is judged by, shaped like `x`). An absmax quantizer gives `x` back within
    its bound of the group maximum. A static-scale one saturates: beyond
    `saturation_limit` it gives ±the limit back, and below `precise_from` its step is
    absolute, so the magnitude judged by is at least `precise_from`."""
    reference = x.double()
    if not quantizer.static_scale:
        return reference, group_amax(x, quantizer.granularity)
    limit = quantizer.saturation_limit
    reference = reference.clamp(-limit, limit)
    return reference, group_amax(reference, quantizer.granularity).clamp_min(quantizer.precise_from)


def group_rows(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """`x` as `[groups, group_size]`: one row per scale group."""
    return x.reshape(1, -1) if granularity == PER_TENSOR else x.reshape(-1, x.shape[-1])


def group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """The largest magnitude of each element's scale group, float64, shaped like `x`."""
    rows = group_rows(x.detach().double().abs(), granularity)
    return rows.amax(dim=-1, keepdim=True).expand_as(rows).reshape(x.shape)


def with_group_max(rows: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """Scale each row of `rows` so its largest magnitude is exactly its entry of `maxima`."""
    peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return rows / peak * maxima.reshape(-1, 1)


def random_input(shape: tuple[int, ...], granularity: str, gen: torch.Generator,
                 group_maxima: torch.Tensor | float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal random data; with `group_maxima` (one per group, or one for all), each
    group rescaled so its largest magnitude is exactly that value."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if group_maxima is not None:
        rows = group_rows(x, granularity)
        maxima = torch.as_tensor(group_maxima, dtype=torch.float64).expand(rows.shape[0])
        x = with_group_max(rows, maxima).reshape(shape)
    return x.to(dtype)


def magnitudes_per_group(shape: tuple[int, ...], granularity: str, gen: torch.Generator,
                         low: float, high: float) -> torch.Tensor:
    """One group maximum per group, log-uniform in [10**low, 10**high]."""
    groups = group_rows(torch.empty(shape), granularity).shape[0]
    return 10.0 ** (low + (high - low) * torch.rand(groups, generator=gen, dtype=torch.float64))


def scale_problem(quantizer: Quantizer, q: QuantizedTensor, where: str) -> str | None:
    """Guarantee 2's values: the scales are float32, finite and positive."""
    if not isinstance(q.scale, torch.Tensor) or q.scale.dtype != torch.float32:
        return f"{quantizer.name}: {where}: scale is {getattr(q.scale, 'dtype', type(q.scale))}, not torch.float32"
    bad = ~(torch.isfinite(q.scale) & (q.scale > 0))
    if bool(bad.any()):
        first = q.scale.reshape(-1)[bad.reshape(-1)][0].item()
        return (f"{quantizer.name}: {where}: {int(bad.sum())} of {q.scale.numel()} scales are not finite and "
                f"positive (first: {first}); a scale of 0 turns zeros into NaN, an infinite one overflows")
    return None


def roundtrip_problem(quantizer: Quantizer, x: torch.Tensor, where: str, floor: float = 0.0) -> str | None:
    """What breaks guarantees 1-3 when `x` is quantized and dequantized, or None.

    Dequantized to float32, each element must lie within `error_bound` times its
    group's largest magnitude (plus `floor`, an absolute allowance only the
    subnormal check uses) of the input, or for a static-scale quantizer of the
    input saturated at its limit (`expected_back`). The default dtype is checked
    as well, allowed its own rounding (one epsilon of the group maximum)."""
    q = quantizer.quantize(x)
    problem = scale_problem(quantizer, q, where)
    if problem:
        return problem
    reference, amax = expected_back(quantizer, x)
    for out_dtype, got in ((torch.float32, quantizer.dequantize(q, torch.float32)), (x.dtype, quantizer.dequantize(q))):
        allowed = quantizer.error_bound * amax + torch.finfo(out_dtype).eps * amax + floor
        error = (got.double() - reference).abs()
        bad = ~(error <= allowed)  # NaN errors count as bad
        if bool(bad.any()):
            flat = (error - allowed).nan_to_num(nan=float("inf")).reshape(-1)
            i = int(flat.argmax())
            index = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), x.shape))
            return (f"{quantizer.name}: {where}, dequantized to {dtype_name(out_dtype)}: "
                    f"{int(bad.sum())} of {x.numel()} elements outside error_bound {quantizer.error_bound:g} × "
                    f"group max; worst at {index}: input {reference.reshape(-1)[i].item():.6g}, "
                    f"got {got.reshape(-1)[i].item():.6g}, allowed error {allowed.reshape(-1)[i].item():.3g}")
    return None


def describe(x: torch.Tensor, label: str, seed: int) -> str:
    return f"{label}, input {dtype_name(x.dtype)} {tuple(x.shape)}, seed {seed}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN; works for float8, where torch.equal does not)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
