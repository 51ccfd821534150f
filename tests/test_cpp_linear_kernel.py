"""The linear kernels (`kvforge_cpp::bf16_linear` and its float32 twin
`kvforge_cpp::f32_linear`) against float64 on fresh random inputs: odd sizes that leave tails in every tiling (rows not a multiple of
the 4- or 8-row tile, out not a multiple of the 16-channel block or the channel tile,
in odd so the last input pair is half empty), 1 to 129 rows, with and without
bias, each epilogue (none, float32 out, residual add, SiLU(gate) x up), in
bfloat16 and float32, on every
instruction-set path this CPU runs (capped with KVFORGE_CPP_ISA). Deliberately
broken variants fail the same check, and bad input gets a clear error."""

from __future__ import annotations

import pytest
import torch

from kvforge.models.cpp_linear import interleave_blocks, kernel_path, linear, load_kernel, pack_bias, pack_weight

# (rows, in, out): tails of the 8- and 4-row tiles and the 64-row chunk, of 16-channel
# blocks and 32- and 64-channel tiles, and an odd `in` (a half-empty last input pair);
# 1 to 7 rows also run as one row tile of four blocks, or a walk of four blocks in
# chunks of 8 inputs, where a path does that (out 100: seven blocks, a four-block
# tile and a three-block tail; 14 interleaved for silu_mul).
SHAPES = [(1, 37, 23), (3, 100, 70), (8, 515, 129), (33, 48, 9), (129, 130, 67), (6, 1, 17), (75, 33, 50),
          (4, 70, 100), (5, 131, 64), (2, 66, 100), (1, 45, 100), (7, 50, 100), (6, 64, 100)]
LEVELS = ("avx512", "avx2", "baseline")  # the cap; avx512 runs avx512_bf16 where the CPU has it
EPILOGUES = ("none", "float_out", "add", "silu_mul")
ACCUMULATION = 2e-6  # float32 sums: a few ulps of the sum of |terms| (in <= 515 here)
BF16_HALF_ULP = 2.0**-8  # of |result|, for bfloat16 output
FLOAT32_ROUNDINGS = 2.0**-23  # of |result| + |residual|: float32 output, rounded after the residual add
DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_kernel()


def operands(rows: int, k: int, n: int, bias: bool, epilogue: str, dtype=torch.bfloat16):
    """Fresh random operands of `dtype` (a new draw every run), weights of two
    projections for silu_mul; channel n // 2 much larger, so a mixed-up channel shows."""
    x = torch.randn(rows, k).to(dtype)
    count = 2 if epilogue == "silu_mul" else 1
    ws = [torch.randn(n, k) * 0.3 for _ in range(count)]
    for w in ws:
        w[n // 2] *= 30
    ws = [w.to(dtype) for w in ws]
    bs = [torch.randn(n) if bias else None for _ in range(count)]
    other = torch.randn(rows, n).to(dtype) if epilogue == "add" else None
    return x, ws, bs, other


def run_kernel(x, ws, bs, other, epilogue: str, pack=pack_weight):
    n = ws[0].shape[0]
    if epilogue == "silu_mul":
        packed = interleave_blocks(pack(ws[0]), pack(ws[1]))
        bias = None
        if bs[0] is not None:
            bias = torch.stack([pack_bias(b, n).view(-1, 16) for b in bs], dim=1).flatten().contiguous()
        return linear(x, packed, n, bias, "silu_mul", None)
    mode = "add" if epilogue == "add" else "none"
    return linear(x, pack(ws[0]), n, pack_bias(bs[0], n), mode, other, epilogue == "float_out")


def kernel_error(out, x, ws, bs, other, epilogue: str) -> float:
    """Largest error of `out` against float64, in units of its allowed error; <= 1 passes."""
    x64 = x.double()
    sums, bounds = [], []
    for w, b in zip(ws, bs):
        w64 = w.double()
        sums.append(x64 @ w64.T + (0 if b is None else b.double()))
        bounds.append(ACCUMULATION * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())))
    if epilogue == "silu_mul":
        gate, up = sums
        silu = gate * torch.sigmoid(gate)
        ref = silu * up
        # |silu'| <= 1.1: the gate's error passes through scaled by |up|
        allowed = 1.1 * up.abs() * bounds[0] + silu.abs() * bounds[1] + 1e-6 * ref.abs()
    else:
        ref, allowed = sums[0], bounds[0]
        if other is not None:
            ref = ref + other.double()
            allowed = allowed + FLOAT32_ROUNDINGS * (ref.abs() + other.double().abs())
    if epilogue != "float_out" and x.dtype == torch.bfloat16:
        allowed = allowed + BF16_HALF_ULP * ref.abs()
    assert out.shape == ref.shape
    assert out.dtype == (torch.float32 if epilogue == "float_out" else x.dtype)
    return float(((out.double() - ref).abs() / (allowed + 1e-30)).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_float64_on_every_path(dtype, level, epilogue, bias, shape, monkeypatch):
    if dtype == torch.float32 and epilogue == "float_out":
        pytest.skip("float32 output is the float32 kernel's only output")
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    path = kernel_path()
    if not path.startswith(level):  # the CPU lacks this level: the cap cannot raise it
        pytest.skip(f"this CPU runs {path}, not {level}")
    x, ws, bs, other = operands(*shape, bias, epilogue, dtype)
    out = run_kernel(x, ws, bs, other, epilogue)
    assert kernel_error(out, x, ws, bs, other, epilogue) <= 1


def test_every_level_names_its_path(monkeypatch):
    for level in LEVELS:
        monkeypatch.setenv("KVFORGE_CPP_ISA", level)
        assert kernel_path() in {"avx512": ("avx512_bf16", "avx512", "avx2", "baseline"), "avx2": ("avx2", "baseline"),
                                 "baseline": ("baseline",)}[level]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
def test_the_check_catches_a_kernel_that_drops_the_last_input(dtype):
    """Packing only the first in - 1 inputs (a tail bug: for bfloat16 the half-empty
    last pair lost) fails the check, though every other term of every sum is right."""
    epilogue = "float_out" if dtype == torch.bfloat16 else "none"
    x, ws, bs, other = operands(5, 37, 23, False, epilogue, dtype)
    assert kernel_error(run_kernel(x, ws, bs, other, epilogue), x, ws, bs, other, epilogue) <= 1

    def drops_last(w):
        w = w.clone()
        w[:, -1] = 0
        return pack_weight(w)

    broken = run_kernel(x, ws, bs, other, epilogue, pack=drops_last)
    assert kernel_error(broken, x, ws, bs, other, epilogue) > 100


def test_the_check_catches_weights_swapped_within_a_pair():
    """A packing that swaps the two inputs of each pair (a layout bug) fails."""
    x, ws, bs, other = operands(4, 64, 32, False, "none")
    broken = run_kernel(x, ws, bs, other, "none", pack=lambda w: pack_weight(w).flip(-1).contiguous())
    assert kernel_error(broken, x, ws, bs, other, "none") > 10


def test_the_check_catches_gate_and_up_swapped():
    """silu(up) * gate is not silu(gate) * up: the check tells them apart."""
    x, ws, bs, other = operands(4, 40, 40, True, "silu_mul")
    broken = run_kernel(x, ws[::-1], bs[::-1], other, "silu_mul")
    assert kernel_error(broken, x, ws, bs, other, "silu_mul") > 10


def test_the_check_catches_a_float32_block_left_untransposed():
    """float32 packed as [blocks, 16, in] read as [blocks, in, 16] (a layout bug) fails."""
    x, ws, bs, other = operands(4, 48, 32, False, "none", torch.float32)

    def untransposed(w):
        return w.contiguous().view(-1, 16, w.shape[1]).reshape(-1, w.shape[1], 16).contiguous()

    assert kernel_error(run_kernel(x, ws, bs, other, "none"), x, ws, bs, other, "none") <= 1
    broken = run_kernel(x, ws, bs, other, "none", pack=untransposed)
    assert kernel_error(broken, x, ws, bs, other, "none") > 10


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [1, 5], ids=["one_row", "five_rows"])  # a tile of four blocks; a walk of them
def test_the_check_catches_blocks_out_of_order(dtype, rows):
    """Blocks 2 and 3 of a packed weight swapped (a four-block tile or walk reading
    a block of the wrong channels) fail the check."""
    x, ws, bs, other = operands(rows, 40, 100, False, "none", dtype)

    def swapped(w):
        packed = pack_weight(w).clone()
        packed[[2, 3]] = packed[[3, 2]]
        return packed

    assert kernel_error(run_kernel(x, ws, bs, other, "none"), x, ws, bs, other, "none") <= 1
    assert kernel_error(run_kernel(x, ws, bs, other, "none", pack=swapped), x, ws, bs, other, "none") > 10


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("k", [37, 130], ids=["odd_in", "even_in"])
def test_rows_have_the_same_bits_alone_and_among_many(dtype, level, epilogue, k, monkeypatch):
    # A few rows run through tiles of their own (four blocks, or all the rows in one
    # row tile), many through the path's, and many bfloat16 rows as float32 tiles over
    # widened weights: every row's bits must not depend on how many rows came with it.
    if dtype == torch.float32 and epilogue == "float_out":
        pytest.skip("float32 output is the float32 kernel's only output")
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    if not kernel_path().startswith(level):
        pytest.skip(f"this CPU runs {kernel_path()}, not {level}")
    # past the 96 rows from which weights are widened; out 100: four-block tiles and a tail
    x, ws, bs, other = operands(130, k, 100, True, epilogue, dtype)
    together = run_kernel(x, ws, bs, other, epilogue)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 3), slice(2, 6), slice(0, 5), slice(3, 9), slice(20, 27),
                 slice(10, 25), slice(129, 130), slice(0, 100)):
        part = run_kernel(x[rows], ws, bs, None if other is None else other[rows], epilogue)
        assert torch.equal(part, together[rows]), f"rows {rows.start}-{rows.stop - 1} differ"


@pytest.mark.parametrize("rows", [21, 70], ids=["one_chunk", "two_chunks"])  # the decode and the prefill tiles
@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
def test_strided_rows_zero_rows_and_rows_independent(dtype, rows):
    x, ws, bs, other = operands(rows, 40, 24, True, "none", dtype)
    wide = torch.zeros(rows, 64, dtype=dtype)
    wide[:, 7:47] = x
    packed, bias = pack_weight(ws[0]), pack_bias(bs[0], 24)
    first = linear(x, packed, 24, bias, "none", None)
    assert torch.equal(linear(wide[:, 7:47], packed, 24, bias, "none", None), first)  # rows 64 apart
    assert linear(x[:0], packed, 24, bias, "none", None).shape == (0, 24)
    changed = x.clone()
    changed[1:] = torch.randn(rows - 1, 40).to(dtype) * 50
    # no tile reads a neighbour's inputs
    assert torch.equal(linear(changed, packed, 24, bias, "none", None)[0], first[0])


@pytest.mark.parametrize("bad, message", [
    (lambda x, p, n: (x.float(), p, n), "2-D bfloat16"),
    (lambda x, p, n: (x[:, :10], p, n), "input pairs"),
    (lambda x, p, n: (x, p.view(-1, 16, 2), n), r"\[blocks, pairs, 16, 2\]"),
    (lambda x, p, n: (x, p, n + 16), "does not fit"),
])
def test_bad_input_gets_a_clear_error(bad, message):
    x, ws, _, _ = operands(2, 16, 8, False, "none")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvforge_cpp.bf16_linear(*bad(x, pack_weight(ws[0]), 8))


@pytest.mark.parametrize("bad, message", [
    (lambda x, p, n: (x.bfloat16(), p, n), "2-D float32"),
    (lambda x, p, n: (x[:, :10], p, n), "input features but the packed weight holds 16"),
    (lambda x, p, n: (x, p.bfloat16(), n), r"float32 \[blocks, in, 16\]"),
    (lambda x, p, n: (x, p, n + 16), "does not fit"),
])
def test_bad_float32_input_gets_a_clear_error(bad, message):
    x, ws, _, _ = operands(2, 16, 8, False, "none", torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvforge_cpp.f32_linear(*bad(x, pack_weight(ws[0]), 8))
    with pytest.raises(RuntimeError, match=r"needs `other`, a float32"):
        torch.ops.kvforge_cpp.f32_linear(x, pack_weight(ws[0]), 8, None, "add", torch.zeros(2, 8).bfloat16())


def test_bad_epilogue_and_residual_get_a_clear_error():
    x, ws, _, _ = operands(2, 16, 8, False, "none")
    op, packed = torch.ops.kvforge_cpp.bf16_linear, pack_weight(ws[0])
    with pytest.raises(RuntimeError, match="'none', 'add' or 'silu_mul'"):
        op(x, packed, 8, None, "gelu")
    with pytest.raises(RuntimeError, match=r"needs `other`.*\[2, 8\]"):
        op(x, packed, 8, None, "add", torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="silu_mul.*even"):
        op(x, packed, 8, None, "silu_mul")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float32"])
def test_no_input_features_give_the_epilogue_of_zero_sums(dtype):
    """The ops answer an empty input width themselves: the tiles are compiled on
    the promise that they never see one (linear_tile.h, "k >= 1")."""
    bias, other = torch.randn(24), torch.randn(5, 24).to(dtype)
    packed = torch.empty((2, 0, 16) if dtype == torch.float32 else (2, 0, 16, 2), dtype=dtype)
    y = linear(torch.randn(5, 0).to(dtype), packed, 24, pack_bias(bias, 24), "add", other)
    assert torch.equal(y, (bias + other.float()).to(dtype))


def test_fake_implementation_gives_the_output_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, packed = torch.empty(3, 40, dtype=torch.bfloat16), torch.empty(1, 20, 16, 2, dtype=torch.bfloat16)
        assert torch.ops.kvforge_cpp.bf16_linear(x, packed, 7).dtype == torch.bfloat16
        y = torch.ops.kvforge_cpp.bf16_linear(x, packed, 7, float_out=True)
        assert y.shape == (3, 7) and y.dtype == torch.float32
        y = torch.ops.kvforge_cpp.f32_linear(torch.empty(3, 40), torch.empty(1, 40, 16), 7)
        assert y.shape == (3, 7) and y.dtype == torch.float32
