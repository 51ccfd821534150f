"""The C++ RMSNorm and rotary kernels (`kvforge_cpp::rms_norm`, `kvforge_cpp::rotary`)
against float64 on fresh random inputs: widths that leave tails after the
16-lane steps (1, 17, 62, 130), 1 to 129 rows, 2-D rows and 3-D strided views into
a wider tensor (how q and k sit in the fused q/k/v output), float32 and bfloat16,
every instruction-set path (capped with KVFORGE_CPP_ISA); deliberately broken
inputs fail the same check; the model layers switch to them and stay within
bfloat16's tolerance of the torch path."""

from __future__ import annotations

import pytest
import torch

from kvforge.models.layers import RMSNorm, RotaryEmbedding, rotate
from kvforge.models.cpp_linear import load_kernel

LEVELS = ("avx512", "avx2", "baseline")
DTYPES = (torch.float32, torch.bfloat16)
# float32: a few ulps of the float32 math; bfloat16: two roundings (HF's order rounds the
# normalised row before the weight multiplies it), each at most half a bfloat16 ulp.
RELATIVE = {torch.float32: 2e-6, torch.bfloat16: 2.0**-7 + 2.0**-8}
SHAPES = [(1, 1, 17), (5, 3, 62), (129, 2, 130), (7, 4, 64)]  # (tokens, heads, d)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_kernel()


def strided_rows(tokens: int, heads: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, d] as a view into a wider tensor, rows 3 heads and 5 values apart."""
    wide = torch.randn(tokens, heads + 3, d + 5).to(dtype)
    return wide[:, 1:1 + heads, 2:2 + d]


def norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    scaled = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return scaled * w.double()


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x64, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x64[..., :half], x64[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def relative_error(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor) -> float:
    """Largest |out - ref| in units of the allowed error (RELATIVE of `magnitude`); <= 1 passes."""
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    return float(((out.double() - ref).abs() / (RELATIVE[dtype] * magnitude + 1e-30)).max())


def tables(tokens: int, half: int):
    angles = torch.rand(tokens, half) * 100
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_float64_on_every_path(level, dtype, shape, monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    if torch.ops.kvforge_cpp.isa() != level:
        pytest.skip(f"this CPU runs {torch.ops.kvforge_cpp.isa()}, not {level}")
    x = strided_rows(*shape, dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    for rows in (x, x[:, 0]):  # 3-D views and 2-D rows
        ref = norm_reference(rows, w, 1e-5)
        out = torch.ops.kvforge_cpp.rms_norm(rows, w, 1e-5)
        assert relative_error(out, ref, dtype, ref.abs()) <= 1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] % 2 == 0], ids=lambda s: "x".join(map(str, s)))
def test_rotary_matches_float64_on_every_path(level, dtype, shape, monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    if torch.ops.kvforge_cpp.isa() != level:
        pytest.skip(f"this CPU runs {torch.ops.kvforge_cpp.isa()}, not {level}")
    x = strided_rows(*shape, dtype)
    cos, sin = tables(shape[0], shape[2] // 2)
    ref = rotary_reference(x, cos, sin)
    magnitude = x.double().abs() + x.double().abs().roll(shape[2] // 2, dims=-1)  # |x1| + |x2| in each half
    assert relative_error(torch.ops.kvforge_cpp.rotary(x, cos, sin), ref, dtype, magnitude) <= 1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d", (62, 64))
def test_bfloat16_outputs_round_as_torch_does_special_values_included(level, d, monkeypatch):
    """The kernels' float32 -> bfloat16 store, bit for bit torch's on every
    number: ties to even (cos = 1 + 2^-8 puts each product exactly half a
    bfloat16 ulp up, and bfloat16's largest finite value over the top) and
    infinities; every NaN, whatever its payload, as the one quiet NaN 0x7fc0
    (a payload of 0x7fff would carry into the sign bit without the NaN check
    and come out as -0.0)."""
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    if torch.ops.kvforge_cpp.isa() != level:
        pytest.skip(f"this CPU runs {torch.ops.kvforge_cpp.isa()}, not {level}")
    tokens, half = 9, d // 2
    x = torch.randn(tokens, 2, d).bfloat16()
    bits = x.view(torch.int16)
    specials = torch.tensor([0x7FFF, -0x0001, 0x7FC1, 0x7F80, -0x0080, 0x7F7F, -0x0081, 0x0001], dtype=torch.int16)
    bits[:, 0, :len(specials)] = specials  # NaNs with payloads, -NaN, +-inf, +-largest finite, a subnormal
    cos = torch.full((tokens, half), 1 + 2.0**-8)
    cos[::2] = 1.0
    sin = torch.zeros(tokens, half)
    expected = rotary_reference(x.float(), cos, sin).float().to(torch.bfloat16)
    out = torch.ops.kvforge_cpp.rotary(x, cos, sin).view(torch.int16)
    nan = expected.isnan()
    assert nan.any() and expected.isinf().any() and (expected.view(torch.int16) == 0x7F80).any()
    assert torch.equal(out[~nan], expected.view(torch.int16)[~nan])
    assert (out[nan] == 0x7FC0).all()  # torch keeps a payload here; the kernels write the one quiet NaN


def test_the_checks_catch_a_weight_on_the_wrong_channel_and_swapped_tables():
    x = strided_rows(6, 2, 62, torch.bfloat16)
    w = (torch.rand(62) + 0.5).bfloat16()
    ref = norm_reference(x, w, 1e-5)
    broken = torch.ops.kvforge_cpp.rms_norm(x, w.roll(1), 1e-5)
    assert relative_error(broken, ref, torch.bfloat16, ref.abs()) > 5
    cos, sin = tables(6, 31)
    magnitude = x.double().abs() + x.double().abs().roll(31, dims=-1)
    broken = torch.ops.kvforge_cpp.rotary(x, sin, cos)
    assert relative_error(broken, rotary_reference(x, cos, sin), torch.bfloat16, magnitude) > 5


def test_the_model_layers_switch_and_agree_with_the_torch_path():
    """RMSNorm and RotaryEmbedding with kernel "cpp" against their torch path on the same
    input, in bfloat16: within a bfloat16 ulp or two (the torch path rounds cos, sin
    and each partial product to bfloat16)."""
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    norm = norm.bfloat16()
    x = torch.randn(9, 64).bfloat16()
    torch_out = norm(x)
    norm.kernel = "cpp"
    torch.testing.assert_close(norm(x), torch_out, rtol=2**-7, atol=0)
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))
    positions = torch.arange(40, 49)
    q = strided_rows(9, 3, 32, torch.bfloat16)
    torch_rotated = rotate(q, *rotary(positions, torch.bfloat16))
    rotary.kernel = "cpp"
    cos, sin = rotary(positions, torch.bfloat16)
    assert cos.dtype == torch.float32 and cos.shape == (9, 16)
    torch.testing.assert_close(rotate(q, cos, sin), torch_rotated, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("head", [32, 64, 128])
def test_rotary_table_rows_are_bitwise_a_steps_own_cos_and_sin(head):
    """Kernel "cpp" takes each position's row of `tables`, made once: it must be bitwise
    the cos and sin a step computes from its positions alone (float32 angles
    position x inv_freq), for positions past the first table (which then grows),
    in any order and with repeats."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
    rotary = RotaryEmbedding(inv_freq)
    rotary.kernel = "cpp"
    first = rotary.tables(8)[0].shape[0]
    positions = torch.cat([torch.randint(0, 5 * first, (200,)), torch.tensor([0, 5 * first - 1, 7, 7])])
    cos, sin = rotary(positions, torch.float32)
    assert rotary.tables(1)[0].shape[0] >= 5 * first > first  # grown to cover them
    angles = positions.float()[:, None] * inv_freq[None, :]
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    assert torch.equal(rotary(positions, torch.float32, limit=5 * first)[0], cos)  # a bound given, the same rows
    shifted = (positions + 1).float()[:, None] * inv_freq[None, :]  # a table off by one position fails
    assert not torch.equal(cos, shifted.cos())


@pytest.mark.parametrize("call, message", [
    (lambda: torch.ops.kvforge_cpp.rms_norm(torch.zeros(2, 8).half(), torch.zeros(8).half(), 1e-5), "float32 or bf"),
    (lambda: torch.ops.kvforge_cpp.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5), "8 values in x's dtype"),
    (lambda: torch.ops.kvforge_cpp.rotary(torch.zeros(2, 1, 8), torch.zeros(2, 3), torch.zeros(2, 4)), r"\[2, 4\]"),
    (lambda: torch.ops.kvforge_cpp.rotary(torch.zeros(2, 1, 7), torch.zeros(2, 3), torch.zeros(2, 3)), "even"),
])
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_fake_implementations_give_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 2, 8, dtype=torch.bfloat16)
        assert torch.ops.kvforge_cpp.rms_norm(x, torch.empty(8, dtype=torch.bfloat16), 1e-5).shape == (3, 2, 8)
        y = torch.ops.kvforge_cpp.rotary(x, torch.empty(3, 4), torch.empty(3, 4))
        assert y.shape == (3, 2, 8) and y.dtype == torch.bfloat16
