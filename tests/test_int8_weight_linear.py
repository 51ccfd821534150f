"""The weight-only int8 linear kernel (`kvforge_cpp::int8_weight_linear`) against
float64 `x @ (w_int8 * scale)^T + bias` on fresh random inputs: odd sizes that
leave tails in every tiling (out not a multiple of the 2- and 4-channel tiles or
the 64-channel blocks, in not a multiple of the 16- and 32-wide steps), 1 to 260
rows (from 32 rows, float32 rows take weights widened group by group into the
float32 tiles, sixteen channels transposed in registers at a time; bfloat16 rows
from 64; the batch tiles' 64-row chunks with rows left over), with and
without bias, float32 and bfloat16, on every instruction-set path this CPU runs
(capped with KVFORGE_CPP_ISA); a deliberately broken kernel fails the same
check, and bad input gets a clear error."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import dtype_name
from kvforge.models.quantized_linear import load_weight_only_kernel

# (rows, in, out); 8 rows take the batch tiles, 33 rows and more the widening path
# for float32 rows, 64 and more for bfloat16 rows (whole 16-channel blocks and a
# partial one, in with a tail of the 16-wide steps at 260 and 70, an odd one at
# 37, and at 515 in the tiles); 260 x 2100 x 150 widens in
# at least two channel groups (1.2 MiB of float32 in all; two at one or two
# threads, 80 and 70 channels, more where more threads run).
SHAPES = [(1, 37, 23), (3, 100, 70), (8, 515, 129), (33, 48, 9), (64, 260, 67), (150, 70, 37), (70, 37, 40), (260, 2100, 150)]
# Both int8 linear ops (weight-only and W8A8) share argument checks, a signature
# and the promise that a row's result is its own: tested together below.
INT8_OPS = ["int8_weight_linear", "int8_dynamic_linear"]
# The levels a cap selects and the path name the op reports for float32 / bfloat16 input.
LEVELS = {"avx512": ("avx512", "avx512_bf16"), "avx2": ("avx2", "avx2"), "baseline": ("baseline", "baseline")}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_weight_only_kernel()


def operands(rows: int, k: int, n: int, bias: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, generator=generator) * 0.05 + 1e-3
    scale[n // 2] *= 100  # channels of very different ranges: a scale on the wrong channel shows
    b = torch.randn(n, generator=generator) if bias else None
    return x, w, scale, b


def kernel_error(linear, x, w, scale, b) -> float:
    """Largest error of `linear(x, w, scale, b)` against float64, in units of its
    allowed error: float32 accumulation (a few ulps of the sum of |terms|) plus,
    for bfloat16 output, half an ulp of each result. <= 1 passes."""
    x64, w64 = x.double(), w.double() * scale.double()[:, None]
    ref = x64 @ w64.T + (0 if b is None else b.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    allowed = 1.01e-6 * magnitude + (2.0**-8 * ref.abs() if x.dtype == torch.bfloat16 else 0) + 1e-30
    out = linear(x, w, scale, b)
    assert out.shape == ref.shape and out.dtype == x.dtype
    return float(((out.double() - ref).abs() / allowed).max())


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_float64_on_every_path(level, dtype, bias, shape, monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    path = torch.ops.kvforge_cpp.int8_linear_path(dtype_name(dtype))
    if path not in LEVELS[level]:  # the CPU lacks this level: the cap cannot raise it
        pytest.skip(f"this CPU runs {path}, not {level}")
    assert path == LEVELS[level][dtype == torch.bfloat16]
    x, w, scale, b = operands(*shape, bias, seed=hash((shape, bias)) % 1000)
    x = x.to(dtype)
    assert kernel_error(torch.ops.kvforge_cpp.int8_weight_linear, x, w, scale, b) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [4, 260], ids=["tiles", "widened"])
def test_the_check_catches_a_kernel_that_drops_the_tail_of_the_input(rows, dtype):
    """Skipping the last in % 16 inputs (a tiling bug) fails the check above, even
    though most of every sum is right: the check is not one any output passes,
    on the register tiles' path or the prefill's widened one alike."""
    x, w, scale, b = operands(rows, 37, 23, True, seed=1)
    x = x.to(dtype)

    def drops_tail(x, w, scale, b):
        return torch.ops.kvforge_cpp.int8_weight_linear(x[:, :32].contiguous(), w[:, :32].contiguous(), scale, b)

    assert kernel_error(torch.ops.kvforge_cpp.int8_weight_linear, x, w, scale, b) <= 1
    assert kernel_error(drops_tail, x, w, scale, b) > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [2, 260], ids=["tiles", "widened"])
def test_the_check_catches_a_scale_applied_on_the_wrong_channel(rows, dtype):
    x, w, scale, b = operands(rows, 48, 40, False, seed=2)
    x = x.to(dtype)

    def rolled_scale(x, w, scale, b):
        return torch.ops.kvforge_cpp.int8_weight_linear(x, w, scale.roll(1), b)

    assert kernel_error(rolled_scale, x, w, scale, b) > 100


def test_strided_rows_and_zero_rows():
    x, w, scale, b = operands(5, 40, 24, True, seed=3)
    wide = torch.zeros(5, 64)
    wide[:, 7:47] = x
    strided = wide[:, 7:47]  # rows 64 apart
    op = torch.ops.kvforge_cpp.int8_weight_linear
    torch.testing.assert_close(op(strided, w, scale, b), op(x, w, scale, b), rtol=0, atol=0)
    assert op(torch.empty(0, 40), w, scale, b).shape == (0, 24)


@pytest.mark.parametrize("op_name", INT8_OPS)
@pytest.mark.parametrize("rows", [1, 3, 9, 30])
def test_a_rows_result_does_not_depend_on_the_other_rows(rows, op_name):
    """Changing every other row leaves row 0's output bit for bit the same (no tile
    reads a neighbour's inputs; W8A8 scales each row by its own absmax), and the
    output is the same on every call. Both int8 ops, on each of their paths."""
    x, w, scale, b = operands(rows, 100, 33, True, seed=4)
    op = getattr(torch.ops.kvforge_cpp, op_name)
    first = op(x, w, scale, b)
    changed = x.clone()
    changed[1:] = torch.randn(rows - 1, 100) * 50
    assert torch.equal(op(changed, w, scale, b)[0], first[0])
    assert torch.equal(op(x, w, scale, b), first)


@pytest.mark.parametrize("op", INT8_OPS)
@pytest.mark.parametrize("bad, message", [
    (lambda x, w, s: (x.half(), w, s), "float32 or bfloat16"),
    (lambda x, w, s: (x, w.float(), s), "contiguous int8"),
    (lambda x, w, s: (x[:, :10], w, s), "input features"),
    (lambda x, w, s: (x, w, s[:-1]), "one value per output channel"),
])
def test_bad_input_gets_a_clear_error(op, bad, message):
    x, w, scale, _ = operands(2, 16, 8, False, seed=5)
    with pytest.raises(RuntimeError, match=f"kvforge_cpp.{op}: .*{message}"):
        getattr(torch.ops.kvforge_cpp, op)(*bad(x, w, scale))


@pytest.mark.parametrize("op", INT8_OPS)
def test_fake_implementation_gives_the_output_shape_and_dtype(op):
    """For FakeTensor tracing (torch.compile): `[rows, out]` in the input's dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dtype in (torch.float32, torch.bfloat16):
            y = getattr(torch.ops.kvforge_cpp, op)(torch.empty(3, 40, dtype=dtype),
                                                   torch.empty(7, 40, dtype=torch.int8), torch.empty(7))
            assert y.shape == (3, 7) and y.dtype == dtype


@pytest.mark.parametrize("op_name", INT8_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 30, 70, 300])
def test_two_threads_give_the_bits_of_one(op_name, dtype, rows):
    """The parallel splits (channel blocks, widened channel groups, whose count
    follows the threads, and W8A8's row passes) change who computes an output,
    never how: the same bits at one and at two threads, on every path."""
    x, w, scale, b = operands(rows, 300, 150, True, seed=rows)
    x = x.to(dtype)
    op = getattr(torch.ops.kvforge_cpp, op_name)
    torch.set_num_threads(1)
    one = op(x, w, scale, b)
    torch.set_num_threads(2)  # the autouse fixture restores the count
    assert torch.equal(op(x, w, scale, b), one)
