"""The epilogues of the int8 linears (`epilogue="add"` with a residual `other`, and
`"silu_mul"` over gate and up rows alternating in blocks of 16), which the
C++ decoder stack and `Int8Linear.binary` / `Int8GateUp` run instead of torch
ops after the kernel: weight-only on an unpacked and on a packed weight, and
W8A8, float32 and bfloat16, decodes and batches (the widened paths from 32
rows), against float64 on fresh random inputs. In float32 "add" is exactly
the plain op's output plus the residual (one float32 add: nothing else
changes); a model whose gate and up are fused runs the same numbers in the
stack as in Python."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.models.quantized_linear import (Int8GateUp, Int8Linear, alternate_blocks, fuse_int8_gate_up,
                                             load_w8a8_kernel, load_weight_only_kernel, quantize_rows)
from tests.test_int8_weight_linear import operands


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_weight_only_kernel()
    assert load_w8a8_kernel()


def packed(w):
    return torch.ops.kvforge_cpp.int8_pack_weight(w)


# (name, the op's name (it takes x, weight, scale, bias, epilogue, other), how it holds the weight)
OPS = {
    "weight-only": ("int8_weight_linear", lambda w: w),
    "weight-only packed": ("int8_weight_linear", packed),
    "w8a8": ("int8_dynamic_linear", lambda w: w),
}


def op_of(kind: str):
    name, hold = OPS[kind]
    return getattr(torch.ops.kvforge_cpp, name), hold


def float64_sums(kind: str, x, w, scale, b):
    """What the op computes before its epilogue, in float64: W8A8 on x rounded to int8
    row by row as the kernel rounds it (quantize_rows), weight-only on x itself."""
    if kind == "w8a8":
        q, x_scale = quantize_rows(x.float())
        x64 = q.double() * x_scale.double()
    else:
        x64 = x.double()
    w64 = w.double() * scale.double()[:, None]
    magnitude = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    return x64 @ w64.T + (0 if b is None else b.double()), magnitude


def allowed(magnitude, ref, dtype):
    """float32 accumulation error plus, for bfloat16 results, half an ulp of each."""
    return 2e-6 * magnitude + (2.0**-8 * ref.abs() if dtype == torch.bfloat16 else 0) + 1e-30


@pytest.mark.parametrize("kind", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("out", [64, 70])
def test_add_adds_the_residual_to_the_sums_before_the_one_rounding(kind, dtype, rows, out):
    op, hold = op_of(kind)
    x, w, scale, b = operands(rows, 48, out, True, seed=rows * 1000 + out)
    x = x.to(dtype)
    other = torch.randn(rows, out).to(dtype)
    y = op(x, hold(w), scale, b, "add", other)
    assert y.shape == (rows, out) and y.dtype == dtype
    ref, magnitude = float64_sums(kind, x, w, scale, b)
    ref = ref + other.double()
    error = (y.double() - ref).abs() / allowed(magnitude + other.double().abs(), ref, dtype)
    assert float(error.max()) <= 1
    if dtype == torch.float32:  # the plain op's output and one float32 add: bit for bit
        assert torch.equal(y, op(x, hold(w), scale, b) + other)


@pytest.mark.parametrize("kind", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("inner", [16, 48, 64])
def test_silu_mul_multiplies_each_gate_blocks_silu_with_the_up_block_beside_it(kind, dtype, rows, inner):
    op, hold = op_of(kind)
    x, gate, gate_scale, gate_bias = operands(rows, 40, inner, True, seed=rows + inner)
    _, up, up_scale, up_bias = operands(rows, 40, inner, True, seed=rows + inner + 1)
    x = x.to(dtype)
    w, scale, b = (alternate_blocks(gate, up), alternate_blocks(gate_scale, up_scale),
                   alternate_blocks(gate_bias, up_bias))
    y = op(x, hold(w), scale, b, "silu_mul", None)
    assert y.shape == (rows, inner) and y.dtype == dtype
    g, g_mag = float64_sums(kind, x, gate, gate_scale, gate_bias)
    u, u_mag = float64_sums(kind, x, up, up_scale, up_bias)
    ref = F.silu(g) * u
    # each factor's float32 error carried through the product (silu' is at most 1.1)
    bound = 1.1 * allowed(g_mag, g, torch.float32) * u.abs() + F.silu(g).abs() * allowed(u_mag, u, torch.float32)
    bound = bound + 1e-6 * ref.abs() + (2.0**-8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert float(((y.double() - ref).abs() / bound).max()) <= 1


@pytest.mark.parametrize("kind", ["weight-only", "weight-only packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [40, 70])
def test_the_widened_path_runs_its_epilogue_in_every_channel_group(kind, dtype, rows):
    """From 32 rows the weight-only ops widen the weight in groups of about 1 MiB,
    each group's tiles writing its own columns and running the epilogue there:
    weights of several groups (and a last one cut short), "add" and "silu_mul".
    From 64 bfloat16 rows on AVX-512 BF16 the groups are bfloat16 products, whose
    float32 sums the epilogue takes before the one rounding."""
    op, hold = op_of(kind)
    inner = 4128  # gate and up: 8,256 channels of 64 inputs, 2.1 MB as float32
    x, gate, gate_scale, gate_bias = operands(rows, 64, inner, True, seed=11)
    _, up, up_scale, up_bias = operands(rows, 64, inner, True, seed=12)
    x = x.to(dtype)
    w, scale, b = (alternate_blocks(gate, up), alternate_blocks(gate_scale, up_scale),
                   alternate_blocks(gate_bias, up_bias))
    y = op(x, hold(w), scale, b, "silu_mul", None)
    g, g_mag = float64_sums(kind, x, gate, gate_scale, gate_bias)
    u, u_mag = float64_sums(kind, x, up, up_scale, up_bias)
    ref = F.silu(g) * u
    bound = 1.1 * allowed(g_mag, g, torch.float32) * u.abs() + F.silu(g).abs() * allowed(u_mag, u, torch.float32)
    bound = bound + 1e-6 * ref.abs() + (2.0**-8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert y.shape == (rows, inner) and float(((y.double() - ref).abs() / bound).max()) <= 1
    other = torch.randn(rows, 2 * inner).to(dtype)
    added = op(x, hold(w), scale, b, "add", other)
    ref, magnitude = float64_sums(kind, x, w, scale, b)
    ref = ref + other.double()
    error = (added.double() - ref).abs() / allowed(magnitude + other.double().abs(), ref, dtype)
    assert float(error.max()) <= 1
    if dtype == torch.float32:
        assert torch.equal(added, op(x, hold(w), scale, b) + other)


def test_the_check_catches_gate_and_up_read_from_the_wrong_blocks():
    # gate and up side by side as two halves (not alternating blocks): the same weights,
    # but every block pairs the wrong channels, which the reference must reject
    x, gate, gate_scale, _ = operands(2, 40, 32, False, seed=7)
    _, up, up_scale, _ = operands(2, 40, 32, False, seed=8)
    halves = torch.ops.kvforge_cpp.int8_weight_linear(x, torch.cat([gate, up]), torch.cat([gate_scale, up_scale]),
                                                        None, "silu_mul", None)
    g, _ = float64_sums("weight-only", x, gate, gate_scale, None)
    u, _ = float64_sums("weight-only", x, up, up_scale, None)
    assert not torch.allclose(halves.double(), F.silu(g) * u, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", list(OPS))
def test_a_wrong_epilogue_gets_a_clear_error(kind):
    op, hold = op_of(kind)
    x, w, scale, _ = operands(2, 16, 48, False, seed=1)
    with pytest.raises(RuntimeError, match="epilogue must be 'none', 'add' or 'silu_mul', got 'gelu'"):
        op(x, hold(w), scale, None, "gelu", None)
    with pytest.raises(RuntimeError, match="epilogue 'add' needs `other`"):
        op(x, hold(w), scale, None, "add", None)
    with pytest.raises(RuntimeError, match=r"epilogue 'add' needs `other`, a float32 \[rows, out_features\] = \[2, 48\]"):
        op(x, hold(w), scale, None, "add", torch.zeros(2, 47))
    with pytest.raises(RuntimeError, match="`other` is only read by epilogue 'add'"):
        op(x, hold(w), scale, None, "none", torch.zeros(2, 48))
    with pytest.raises(RuntimeError, match="multiple of 32 of them, got 48"):
        op(x, hold(w), scale, None, "silu_mul", None)


@pytest.mark.parametrize("activations", ["none", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_gate_up_is_the_two_layers_it_fuses(activations, dtype):
    x, gate_w, gate_scale, gate_bias = operands(3, 40, 64, True, seed=11)
    _, up_w, up_scale, _ = operands(3, 40, 64, False, seed=12)
    gate = Int8Linear(gate_w, gate_scale, gate_bias, activations)
    up = Int8Linear(up_w, up_scale, None, activations)
    fused = fuse_int8_gate_up(gate, up, dtype)
    assert isinstance(fused, Int8GateUp) and fused.out_features == 64 and fused.in_features == 40
    x = x.to(dtype).view(3, 1, 40)  # any leading shape, as the models call it
    y = fused(x)
    assert y.shape == (3, 1, 64) and y.dtype == dtype
    wide = x.float()  # the layers in float32: the fused one rounds once, after the product
    ref = F.silu(gate(wide)) * up(wide)
    torch.testing.assert_close(y.float(), ref, rtol=2.0**-8 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6 * float(ref.abs().max()))
    # what it cannot serve stays two layers
    assert fuse_int8_gate_up(gate, Int8Linear(up_w[:48], up_scale[:48], None, activations), dtype) is None
    assert fuse_int8_gate_up(gate, up, torch.float16) is None
    odd = Int8Linear(gate_w[:40], gate_scale[:40], None, activations)
    assert fuse_int8_gate_up(odd, odd, dtype) is None  # 40 channels: no whole blocks of 16


def test_int8_linear_binary_adds_in_the_kernels_epilogue(monkeypatch):
    x, w, scale, b = operands(4, 32, 64, True, seed=3)
    layer = Int8Linear(w, scale, b)
    other = torch.randn(4, 64)
    epilogues, call = [], Int8Linear.call
    monkeypatch.setattr(Int8Linear, "call", lambda self, rows, epilogue, residual:
                        epilogues.append(epilogue) or call(self, rows, epilogue, residual))
    y = layer.binary(x.view(2, 2, 32), other.view(2, 2, 64), "add")  # any leading shape, as the models call it
    assert epilogues == ["add"]  # one call of the op with its epilogue, not a torch add after it
    assert y.shape == (2, 2, 64) and torch.equal(y.view(4, 64), layer(x) + other)
    assert torch.equal(layer.binary(x, other, "mul"), layer(x) * other)
