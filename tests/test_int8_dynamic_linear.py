"""The W8A8 linear op (`kvforge_cpp::int8_dynamic_linear`): each row of x rounded
to int8 with its own absmax scale, int32 sums, then `acc * s_x * s_w + b`.

It must give the same bits as the torch ops it replaces (`int8_gemm_in_torch`,
the path without the C++ library, itself held to float64 in
test_quantized_linear.py), on every instruction-set level this CPU runs, on
each of its products (AVX-512 VNNI dot products up to 24 rows, oneDNN's
`_int_mm` above; AVX2 dot products at every row count where AVX2 is the best
level), at sizes that leave tails in every step: in not a multiple of
the 64-byte steps, out not a multiple of the 64-channel blocks, rows not a
multiple of the VNNI path's four. Equal bits leave no room for a wrong sum,
scale or rounding; float64 bounds are checked too, for the op itself. Its
argument checks, fake implementation and row independence are tested with the
weight-only op's (test_int8_weight_linear.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvforge.models import quantized_linear
from kvforge.models.quantized_linear import Int8Linear, int8_gemm_in_torch, load_w8a8_kernel

# (rows, in, out): 1-4 rows one VNNI group; 5, 24 several with a remainder; 25
# and 40 oneDNN; in 1 (the outer product), 64 (no tail), 100 and 515 (tails);
# out 130 (three channel blocks, the last partial).
SHAPES = [(1, 37, 23), (3, 100, 70), (4, 64, 130), (5, 515, 129), (24, 100, 33), (25, 48, 9), (40, 130, 67),
          (3, 1, 20), (30, 1, 5)]
LEVELS = ["avx512", "avx2", "baseline"]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert load_w8a8_kernel()


def operands(rows: int, k: int, n: int, bias: bool, seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: each needs its own scale
    x = torch.randn(rows, k, generator=generator) * torch.logspace(-3, 3, rows)[:, None]
    if rows > 2:
        x[1] = 0  # a zero row: zeros out, never a division by zero
        x[2, : (k + 1) // 2] = -x[2].abs().max()  # many values at the row's extreme
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    w[0, 0] = -128  # the one int8 whose sign cannot flip: products must widen, not negate
    scale = torch.rand(n, generator=generator) * 0.05 + 1e-3
    scale[n // 2] *= 100  # a scale on the wrong channel shows
    b = torch.randn(n, generator=generator) if bias else None
    return x.to(dtype), w, scale, None if b is None else b.to(dtype)


def path_at(level: str, rows: int, k: int, monkeypatch) -> str:
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    if torch.ops.kvforge_cpp.isa() != level:  # the CPU lacks this level: the cap cannot raise it
        pytest.skip(f"this CPU runs {torch.ops.kvforge_cpp.isa()}, not {level}")
    return torch.ops.kvforge_cpp.int8_dynamic_linear_path(rows, k)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_op_gives_the_bits_of_the_torch_ops_on_every_path(level, dtype, bias, shape, monkeypatch):
    path = path_at(level, shape[0], shape[1], monkeypatch)
    x, w, scale, b = operands(*shape, bias, seed=hash((shape, bias)) % 1000, dtype=dtype)
    out = torch.ops.kvforge_cpp.int8_dynamic_linear(x, w, scale, b)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    assert torch.equal(out, int8_gemm_in_torch(x, w, scale, b)), path


def test_each_product_is_taken_where_it_should_be(monkeypatch):
    """The paths the test above relies on: VNNI up to 24 rows where the CPU has it."""
    if path_at("avx512", 1, 64, monkeypatch) != "avx512_vnni":
        pytest.skip("this CPU has no AVX-512 VNNI")
    assert [torch.ops.kvforge_cpp.int8_dynamic_linear_path(r, 64) for r in (1, 24, 25)] == \
        ["avx512_vnni", "avx512_vnni", "onednn"]
    assert torch.ops.kvforge_cpp.int8_dynamic_linear_path(30, 1) == "outer_product"


def test_avx2_takes_its_dot_products_at_every_row_count_while_the_sums_stay_exact(monkeypatch):
    assert [path_at("avx2", rows, 64, monkeypatch) for rows in (1, 25, 512)] == ["avx2_dot"] * 3
    assert torch.ops.kvforge_cpp.int8_dynamic_linear_path(4, 65536) == "avx2_dot"
    assert torch.ops.kvforge_cpp.int8_dynamic_linear_path(4, 65537) == "onednn"


@pytest.mark.parametrize("rows", [2, 30], ids=["vnni", "onednn"])
def test_the_op_is_within_the_rounding_of_the_quantized_math_in_float64(rows):
    """Against float64 on the same quantized operands: the int32 sums are exact, so
    only the float32 scaling rounds (a few ulps of each output)."""
    x, w, scale, b = operands(rows, 100, 48, True, seed=7)
    out = torch.ops.kvforge_cpp.int8_dynamic_linear(x, w, scale, b).double()
    x64 = x.double()
    s_x = (x64.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    product = ((x64 / s_x).round() * s_x) @ (w.double() * scale.double()[:, None]).T
    ref = product + b.double()
    # two products and the bias's addition, each rounded to float32: a few ulps of |product| + |b|
    assert float(((out - ref).abs() / (product.abs() + b.double().abs())).max()) <= 2.5e-7


def test_the_check_catches_a_sum_short_of_its_tail():
    """A kernel that drops the last in % 64 inputs of each row (a step bug) is not
    the same bits, though most of every sum is right."""
    x, w, scale, b = operands(3, 100, 40, True, seed=8)

    def drops_tail(x, w, scale, b):
        return torch.ops.kvforge_cpp.int8_dynamic_linear(x[:, :64].contiguous(), w[:, :64].contiguous(), scale, b)

    assert not torch.equal(drops_tail(x, w, scale, b), int8_gemm_in_torch(x, w, scale, b))


@pytest.mark.parametrize("rows", [3, 30], ids=["vnni", "onednn"])
def test_a_nan_row_gives_nan_outputs_and_leaves_the_others_alone(rows):
    x, w, scale, b = operands(rows, 100, 40, True, seed=9)
    op = torch.ops.kvforge_cpp.int8_dynamic_linear
    clean = op(x, w, scale, b)
    x[0, 70] = float("nan")  # in the 64-byte tail of the VNNI steps
    out = op(x, w, scale, b)
    assert bool(out[0].isnan().all())
    assert torch.equal(out[1:], clean[1:])


def test_strided_rows_and_zero_rows():
    x, w, scale, b = operands(5, 40, 24, True, seed=3)
    wide = torch.zeros(5, 64)
    wide[:, 7:47] = x
    op = torch.ops.kvforge_cpp.int8_dynamic_linear
    assert torch.equal(op(wide[:, 7:47], w, scale, b), op(x, w, scale, b))
    assert torch.equal(op(x.T.contiguous().T, w, scale, b), op(x, w, scale, b))  # columns apart
    assert op(torch.empty(0, 40), w, scale, b).shape == (0, 24)


def test_the_layer_takes_the_op_and_without_the_library_the_torch_ops_with_the_same_bits(monkeypatch, caplog):
    """Without the library W8A8 still runs, the same bits, and says so once, not once per layer."""
    from kvforge.kernels import build

    x, w, scale, b = operands(6, 40, 24, True, seed=6)
    fused = Int8Linear(w, scale, b, "int8")
    assert fused.fused_w8a8

    def fails():
        raise build.CppBuildError("no C++ compiler")

    monkeypatch.setattr(build, "load", fails)
    monkeypatch.setattr(quantized_linear, "_warned", set())  # whatever other tests logged before
    with caplog.at_level(logging.WARNING):
        plain = Int8Linear(w, scale, b, "int8")
        Int8Linear(w, scale, b, "int8")
    assert not plain.fused_w8a8
    assert [r.getMessage() for r in caplog.records] == ["W8A8 linears run as torch ops (slower): no C++ compiler"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(fused(x.to(dtype)), plain(x.to(dtype)))
