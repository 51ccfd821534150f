"""The weight-only int8 linear over a packed weight (`kvforge_cpp::int8_pack_weight`,
the layout `Int8Linear` keeps on CPU: 64 channels of one input side by side)
against float64 `x @ (w_int8 * scale)^T + bias` on fresh random inputs: the
tiles of decodes and small batches (1, 2, 3, 5 rows, and every row count up
to the widening threshold) and the widened paths of larger batches, at sizes
that are no multiple of the 64-channel blocks or of 16 (a partial last
block, one channel, fewer channels than one vector), float32 and bfloat16,
bias or none, on every instruction-set path this CPU runs. The check catches
a kernel that skips the last partial channel block, and the packing is
exactly the documented layout and undone by `int8_unpack_weight`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.core import cdiv
from kvforge.models.quantized_linear import Int8Linear, load_weight_only_kernel
from tests.test_int8_weight_linear import LEVELS, kernel_error, operands

PACK = 64  # channels per packed block (kernels/int8_linear_common.h, kPackChannels)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_weight_only_kernel()


def packed_op(x, w, scale, b):
    """The op as Int8Linear calls it: on the packed weight."""
    return torch.ops.kvforge_cpp.int8_weight_linear(x, torch.ops.kvforge_cpp.int8_pack_weight(w), scale, b)


def on_level(level: str, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    path = torch.ops.kvforge_cpp.int8_linear_path("bfloat16" if dtype == torch.bfloat16 else "float32")
    if path not in LEVELS[level]:  # the CPU lacks this level: the cap cannot raise it
        pytest.skip(f"this CPU runs {path}, not {level}")


@pytest.mark.parametrize("out, k", [(1, 1), (5, 3), (64, 16), (65, 33), (130, 70), (200, 1)])
def test_packing_is_the_documented_layout_and_unpacking_undoes_it(out, k):
    w = torch.randint(-127, 128, (out, k), dtype=torch.int8)
    packed = torch.ops.kvforge_cpp.int8_pack_weight(w)
    blocks = cdiv(out, PACK)
    assert packed.shape == (blocks, k, PACK) and packed.dtype == torch.int8 and packed.is_contiguous()
    padded = torch.zeros(blocks * PACK, k, dtype=torch.int8)
    padded[:out] = w
    # [b][d][c] = w[64 b + c][d], zeros past out
    assert torch.equal(packed, padded.view(blocks, PACK, k).transpose(1, 2))
    assert torch.equal(torch.ops.kvforge_cpp.int8_unpack_weight(packed, out), w)


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.sampled_from([1, 2, 3, 4, 5, 7, 31, 32, 63, 64, 70]), k=st.integers(1, 300),
       out=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_kernel_matches_float64_on_every_path(level, dtype, rows, k, out, bias, seed, monkeypatch):
    on_level(level, dtype, monkeypatch)
    x, w, scale, b = operands(rows, k, out, bias, seed)
    assert kernel_error(packed_op, x.to(dtype), w, scale, b) <= 1


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_no_input_features_give_the_bias(level, rows, monkeypatch):
    """With k = 0 every sum is zero, so each row is the bias (zeros without one), at
    a decode's and a batch's row counts on every path, packed or not (the widened
    paths of 32 rows and more had run their tiles over no inputs and crashed)."""
    on_level(level, torch.float32, monkeypatch)
    w = torch.zeros(100, 0, dtype=torch.int8)
    scale, b = torch.rand(100) + 0.5, torch.randn(100)
    x = torch.empty(rows, 0)
    for op in (packed_op, torch.ops.kvforge_cpp.int8_weight_linear):
        assert torch.equal(op(x, w, scale, b), b.expand(rows, 100))
        assert torch.equal(op(x, w, scale, None), torch.zeros(rows, 100))
        assert torch.equal(op(x.bfloat16(), w, scale, b), b.bfloat16().expand(rows, 100))


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("rows", [2, 3, 5, 6, 7, 12, 13, 31])
@pytest.mark.parametrize("out", [150, 104])
def test_each_row_gets_the_bits_it_gets_alone(level, rows, out, monkeypatch):
    """A decode's one row and the rows of a step verifying drafts or of a small batch
    take different tiles (on AVX2 a walk widening each weight once for groups of up
    to 6 rows, a quarter or half of each line at a time): every row's output is bit
    for bit its output alone, with whole blocks and a partial one of 22 or 40
    channels (two or three quarters of a line) and an input width that leaves a
    short last chunk of the walk. A tile that read a neighbour's inputs, added the
    inputs in another order or scaled a sum twice fails."""
    on_level(level, torch.float32, monkeypatch)
    x, w, scale, b = operands(rows, 300, out, True, seed=rows)
    packed = torch.ops.kvforge_cpp.int8_pack_weight(w)
    together = torch.ops.kvforge_cpp.int8_weight_linear(x, packed, scale, b)
    for r in range(rows):
        alone = torch.ops.kvforge_cpp.int8_weight_linear(x[r:r + 1], packed, scale, b)
        assert torch.equal(together[r:r + 1], alone), f"row {r} of {rows}"
    assert kernel_error(packed_op, x, w, scale, b) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 5, 40, 70])
def test_packed_and_unpacked_weights_give_the_same_math(rows, dtype):
    """Both layouts compute the same outputs within the float32 check (their sums run
    in different orders), at 130 channels: two whole blocks and a partial one."""
    x, w, scale, b = operands(rows, 515, 130, True, seed=rows)
    x = x.to(dtype)
    assert kernel_error(packed_op, x, w, scale, b) <= 1
    assert kernel_error(torch.ops.kvforge_cpp.int8_weight_linear, x, w, scale, b) <= 1


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_check_catches_a_kernel_that_skips_the_last_partial_block(rows):
    """Channels 128..129 (the third block, two channels of 64) left out and zero:
    every other output is right, and the check still fails."""
    x, w, scale, b = operands(rows, 100, 130, False, seed=7)

    def skips_last_block(x, w, scale, b):
        out = packed_op(x, w[:128].contiguous(), scale[:128].contiguous(), b)
        return torch.cat([out, torch.zeros(rows, 2)], dim=1)

    assert kernel_error(packed_op, x, w, scale, b) <= 1
    assert kernel_error(skips_last_block, x, w, scale, b) > 100


def test_a_packed_weight_of_the_wrong_shape_gets_a_clear_error():
    x, w, scale, _ = operands(2, 16, 70, False, seed=5)
    packed = torch.ops.kvforge_cpp.int8_pack_weight(w)
    with pytest.raises(RuntimeError, match="int8_weight_linear: a packed weight must be .*int8_pack_weight.*60 output"):
        torch.ops.kvforge_cpp.int8_weight_linear(x, packed, scale[:60].contiguous())
    with pytest.raises(RuntimeError, match="int8_dynamic_linear: weight must be the int8 \\[out, in\\]"):
        torch.ops.kvforge_cpp.int8_dynamic_linear(x, packed, scale)


def test_the_weight_only_layer_packs_whole_blocks_and_gives_the_weight_back_as_rows():
    """Packed when out is a multiple of 64 (no padding: int8 stays a quarter of
    float32), [out, in] otherwise and for W8A8; the same outputs either way."""
    for out, packed_shape in ((128, (2, 40, PACK)), (70, (70, 40))):
        x, w, scale, b = operands(3, 40, out, True, seed=8)
        layer = Int8Linear(w, scale, b, "none")
        assert layer.weight_int8.shape == packed_shape
        assert torch.equal(layer.int8_rows(), w)
        assert kernel_error(lambda x, *_: layer(x), x, w, scale, b) <= 1
        assert Int8Linear(w, scale, b, "int8").weight_int8.shape == (out, 40)  # W8A8 reads [out, in]
