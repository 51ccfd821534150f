"""The batched LoRA op (`kvforge.kernels.lora_ops.add_lora`) on every path it has:
the C++ op `kvforge_cpp::add_lora` at every instruction-set level this CPU runs
(capped with KVFORGE_CPP_ISA), the torch loop, and the Triton kernels under
Triton's interpreter, each against float64 (`reference_lora`) on fresh random
inputs whose shapes hypothesis draws: 0 to 40 tokens in segments that may be
empty, of the base model (slot -1) or of an adapter repeated in separate
segments; ranks 1 to 64 (tails of every vector width); odd and even
features; float32 and bfloat16; y a column slice of a wider tensor.

Tolerance (`lora_error`): every path sums in float32 in some order, so a sum of
n terms is off by at most n * 2^-24 times the sum of their magnitudes (the
shrink's n = in, the expand's n = R, through the shrink's error), and y is
rounded once to its dtype at the end (half an ulp: 2^-24 of |y| for float32,
2^-8 for bfloat16). Rows of slot -1 segments, and the columns of the wider
tensor outside y, must come back bit for bit. A kernel that reads the
neighbouring segment's adapter, or that touches a base-model row, fails.

The Triton kernels run once in a subprocess (this file run as a script with
TRITON_INTERPRET=1, which must be set before triton is imported); a second
subprocess compiles them for Hopper and Ampere GPUs, which needs no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from kvforge.core import dtype_name
from kvforge.kernels.lora_ops import add_lora, add_lora_torch, lora_kernel_path, reference_lora

LEVELS = ("avx512", "avx2", "baseline")
DTYPES = (torch.float32, torch.bfloat16)
UNIT_ROUNDOFF = 2.0**-24  # float32 sums
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}  # the one rounding of y


# Cases and their check (also used by the interpreter subprocess)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") % 2**31


def make_case(tokens: int, lengths: list[int], seg_slots: list[int], slots: int, rank: int, k: int, n: int,
              dtype: torch.dtype, seed: int, pad: int = 0):
    """Random operands of `dtype` for segments of `lengths` tokens (summing to
    `tokens`) with `seg_slots`; y is columns [pad, pad + n) of a wider tensor
    `wide` when pad > 0. x rows of base-model segments are NaN: a path that
    touches them shows it. Returns (y, x, a, b, seg_starts, seg_slots, wide)."""
    assert sum(lengths) == tokens and len(lengths) == len(seg_slots)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    wide = torch.randn(tokens, n + 2 * pad, generator=gen).to(dtype)
    a = (torch.randn(slots, rank, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(slots, rank, n, generator=gen).to(dtype)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    for g, slot in enumerate(seg_slots):
        if slot < 0:
            x[starts[g]:starts[g + 1]] = float("nan")
    y = wide[:, pad:pad + n]
    return y, x, a, b, starts, torch.tensor(seg_slots, dtype=torch.int64), wide


def lora_error(out: torch.Tensor, y_before: torch.Tensor, x, a, b, starts, slots) -> float:
    """Largest error of `out` (y after the op) against float64, in units of its
    allowed error (<= 1 passes); inf when a base-model row changed at all."""
    ref = reference_lora(y_before, x, a, b, starts, slots)
    magnitude = reference_lora(torch.zeros_like(y_before), x.abs(), a.abs(), b.abs(), starts, slots)
    allowed = (x.shape[1] + a.shape[1] + 2) * UNIT_ROUNDOFF * magnitude
    allowed = allowed + HALF_ULP[out.dtype] * (ref.abs() + allowed)
    base_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    for g, slot in enumerate(slots.tolist()):
        if slot < 0:
            base_rows[starts[g]:starts[g + 1]] = True
    if not torch.equal(out[base_rows].view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32),
                       y_before[base_rows].view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32)):
        return float("inf")
    error = (out.double() - ref).abs()
    if not bool(torch.isfinite(out.double()[~base_rows]).all()):
        return float("inf")
    return float((error / allowed.clamp_min(1e-300)).max()) if error.numel() else 0.0


def run_and_check(kernel, case) -> float:
    """Run `kernel` on `case` (from make_case); its error (lora_error), inf also
    when a column of the wider tensor outside y changed."""
    y, x, a, b, starts, slots, wide = case
    wide_before = wide.clone()
    y_before = y.clone()
    kernel(y, x, a, b, starts, slots)
    outside = torch.ones(wide.shape[1], dtype=torch.bool)
    pad = (wide.shape[1] - y.shape[1]) // 2
    outside[pad:pad + y.shape[1]] = False
    if not torch.equal(wide[:, outside], wide_before[:, outside]):
        return float("inf")
    return lora_error(y, y_before, x, a, b, starts, slots)


def neighbours_adapter(kernel):
    """A planted bug: `kernel` given each segment's neighbour's slot (the next
    segment's, the last one keeping its own) where both have adapters."""
    def wrong(y, x, a, b, starts, slots):
        shifted = slots.clone()
        for g in range(len(slots) - 1):
            if slots[g] >= 0 and slots[g + 1] >= 0:
                shifted[g] = slots[g + 1]
        kernel(y, x, a, b, starts, shifted)
    return wrong


def touches_base_rows(kernel):
    """A planted bug: `kernel` that treats slot -1 as slot 0."""
    def wrong(y, x, a, b, starts, slots):
        kernel(y, x, a, b, starts, slots.clamp_min(0))
    return wrong


# Which cases hypothesis draws


def cases():
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        tokens = draw(st.integers(0, 40))
        cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=0, max_size=5)))
        lengths = [hi - lo for lo, hi in zip([0] + cuts, cuts + [tokens])]
        slots = draw(st.integers(1, 4))
        seg_slots = draw(st.lists(st.integers(-1, slots - 1), min_size=len(lengths), max_size=len(lengths)))
        rank = draw(st.integers(1, 64))
        k, n = draw(st.integers(1, 80)), draw(st.integers(1, 80))
        dtype = draw(st.sampled_from(DTYPES))
        pad = draw(st.sampled_from([0, 3]))
        return make_case(tokens, lengths, seg_slots, slots, rank, k, n, dtype, draw(st.integers(0, 2**31)), pad)

    return case()


# A decode of one-token segments and a prefill segment, past the C++ op's
# 16-token chunk and 256-column chunk (tails of both).
LARGE = {
    "decode": (20, [1] * 20, [i % 7 - 1 for i in range(20)], 6, 16, 129, 300),
    "prefill": (37, [2, 33, 2], [1, 0, 1], 2, 33, 300, 257),
}


@pytest.fixture(scope="module")
def cpp_op():
    from kvforge.kernels import build

    build.load()
    return torch.ops.kvforge_cpp.add_lora


@pytest.fixture(params=LEVELS)
def level(request, cpp_op, monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_ISA", request.param)
    if torch.ops.kvforge_cpp.lora_path() != request.param:
        pytest.skip(f"this CPU does not run the {request.param} path")
    return request.param


def test_cpp_op_matches_float64_on_random_shapes(level, cpp_op):
    from hypothesis import given, settings

    @settings(max_examples=60, deadline=None)
    @given(cases())
    def check(case):
        assert run_and_check(cpp_op, case) <= 1

    check()


@pytest.mark.parametrize("threads", [1, 4])  # 4: few chunks split their ranks across threads too
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", sorted(LARGE))
def test_cpp_op_matches_float64_past_its_chunks(level, cpp_op, shape, dtype, threads):
    tokens, lengths, seg_slots, slots, rank, k, n = LARGE[shape]
    case = make_case(tokens, lengths, seg_slots, slots, rank, k, n, dtype, fresh_seed(), pad=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert run_and_check(cpp_op, case) <= 1
    finally:
        torch.set_num_threads(before)


def test_torch_path_matches_float64_on_random_shapes():
    from hypothesis import given, settings

    @settings(max_examples=40, deadline=None)
    @given(cases())
    def check(case):
        assert run_and_check(add_lora_torch, case) <= 1

    check()


@pytest.mark.parametrize("planted", [neighbours_adapter, touches_base_rows])
@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_the_check_catches_a_wrong_adapter_and_a_touched_base_row(cpp_op, path, planted):
    kernel = cpp_op if path == "cpp" else add_lora_torch
    for dtype in DTYPES:
        case = make_case(9, [3, 1, 4, 1], [0, 1, -1, 1], 2, 5, 24, 17, dtype, seed=fresh_seed())
        assert run_and_check(kernel, case) <= 1
        case = make_case(9, [3, 1, 4, 1], [0, 1, -1, 1], 2, 5, 24, 17, dtype, seed=fresh_seed())
        assert run_and_check(planted(kernel), case) > 1


def test_add_lora_runs_the_cpp_op_once_the_library_is_loaded(cpp_op, monkeypatch):
    from kvforge.kernels import lora_ops

    assert lora_kernel_path("cpu") == f"cpp-{torch.ops.kvforge_cpp.lora_path()}"
    assert lora_kernel_path("cuda") == "triton"
    monkeypatch.setattr(lora_ops, "add_lora_torch", lambda *args: pytest.fail("took the torch path"))
    case = make_case(6, [2, 4], [1, 0], 2, 3, 10, 12, torch.bfloat16, seed=fresh_seed())
    assert run_and_check(add_lora, case) <= 1


def test_add_lora_takes_the_torch_path_without_the_library_or_for_strided_columns(cpp_op, monkeypatch):
    from kvforge.kernels import build, lora_ops

    calls = []
    monkeypatch.setattr(lora_ops, "add_lora_torch", lambda *args: calls.append(args))
    y, x, a, b, starts, slots, _ = make_case(4, [4], [0], 1, 2, 6, 5, torch.float32, seed=1)
    add_lora(y.t().contiguous().t(), x, a, b, starts, slots)  # columns not adjacent: the op needs unit stride
    assert len(calls) == 1
    monkeypatch.setattr(build, "is_loaded", lambda: False)
    monkeypatch.setattr(lora_ops, "_loaded", False)  # as in a process that never loaded the library
    assert lora_kernel_path("cpu") == "torch"
    add_lora(y, x, a, b, starts, slots)
    assert len(calls) == 2


def good_args(dtype=torch.float32):
    y, x, a, b, starts, slots, _ = make_case(5, [2, 3], [0, -1], 3, 4, 6, 7, dtype, seed=0)
    return dict(y=y, x=x, a=a, b=b, seg_starts=starts, seg_slots=slots)


BAD = {  # what is wrong: (changed arguments, words the message must hold)
    "slot out of range": (dict(seg_slots=torch.tensor([3, -1])), ["seg_slots", "3", "-1", "2"]),
    "slot below -1": (dict(seg_slots=torch.tensor([-2, 0])), ["seg_slots", "-2"]),
    "starts short of the tokens": (dict(seg_starts=torch.tensor([0, 2, 4])), ["seg_starts", "token count 5"]),
    "starts decreasing": (dict(seg_starts=torch.tensor([0, 4, 3, 5]), seg_slots=torch.tensor([0, 1, 2])),
                          ["seg_starts", "decrease"]),
    "one slot too many": (dict(seg_slots=torch.tensor([0, 1, 2])), ["seg_slots", "one slot per segment"]),
    "int32 starts": (dict(seg_starts=torch.tensor([0, 2, 5], dtype=torch.int32)), ["seg_starts", "int64"]),
    "a of other features": (dict(a=torch.zeros(3, 4, 8)), ["a", "in"]),
    "b of another rank": (dict(b=torch.zeros(3, 2, 7)), ["b", "[slots, R, out]"]),
    "mixed dtypes": (dict(b=torch.zeros(3, 4, 7, dtype=torch.bfloat16)), ["b", "float32"]),
    "float64": (dict(y=torch.zeros(5, 7, dtype=torch.float64), x=torch.zeros(5, 6, dtype=torch.float64),
                     a=torch.zeros(3, 4, 6, dtype=torch.float64), b=torch.zeros(3, 4, 7, dtype=torch.float64)),
                ["float32 or bfloat16"]),
    "y of other tokens": (dict(y=torch.zeros(4, 7)), ["y", "token"]),
}


@pytest.mark.parametrize("what", sorted(BAD))
@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_bad_inputs_get_an_error_naming_the_argument(cpp_op, path, what):
    changes, words = BAD[what]
    args = good_args() | changes
    kernel = cpp_op if path == "cpp" else add_lora_torch
    with pytest.raises((RuntimeError, ValueError)) as raised:
        kernel(*args.values())
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"


# The Triton kernels, in a subprocess


def interpreter_results() -> dict[str, float]:
    """Each case's error (lora_error units) through the Triton kernels under the interpreter."""
    from kvforge.kernels.lora_triton import add_lora_triton

    shapes = {  # name: (tokens, lengths, seg_slots, slots, rank, in, out)
        "decode, one-token segments": (5, [1, 1, 1, 1, 1], [2, -1, 0, 2, 1], 3, 16, 40, 72),
        "prefill past a token tile, odd sizes": (21, [3, 17, 1], [0, 1, -1], 2, 7, 37, 65),
        "rank past a rank tile, empty segment": (6, [2, 0, 4], [1, 0, 1], 2, 33, 16, 9),
        "all base model": (3, [3], [-1], 1, 4, 8, 8),
        "no tokens": (0, [0], [0], 1, 4, 8, 8),
    }
    results = {}
    for name, (tokens, lengths, seg_slots, slots, rank, k, n) in shapes.items():
        for dtype in DTYPES:
            case = make_case(tokens, lengths, seg_slots, slots, rank, k, n, dtype, fresh_seed(), pad=2)
            results[f"{name}, {dtype_name(dtype)}"] = run_and_check(add_lora_triton, case)
    case = make_case(3, [1, 2], [0, 1], 2, 4, 8, 8, torch.float32, seed=0)
    results["planted wrong adapter (must fail)"] = -run_and_check(neighbours_adapter(add_lora_triton), case)
    return results


def compile_for_gpus() -> dict[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvforge.kernels import lora_triton

    def compile_one(fn, constexprs, types, capability):
        signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=4, num_stages=3))

    results = {}
    for dtype, capability in (("bf16", 90), ("fp16", 80), ("fp32", 90)):
        index = dict(starts_ptr="*i64", slots_ptr="*i64", num_slots="i32", rank="i32", k="i32", n="i32",
                     stride_xt="i64", stride_yt="i64", buf_ptr="*fp32")
        operands = dict(x_ptr=f"*{dtype}", a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", y_ptr=f"*{dtype}")
        try:
            shrink = dict(BLOCK_T=16, BLOCK_K=64, BLOCK_R=16, DOT_FP32=dtype == "fp32")
            compile_one(lora_triton.lora_shrink_kernel, shrink, index | operands, capability)
            expand = dict(BLOCK_T=16, BLOCK_R=16, BLOCK_N=64, Y_BF16=dtype == "bf16")
            compile_one(lora_triton.lora_expand_kernel, expand, index | operands, capability)
            results[f"{dtype}, sm_{capability}"] = None
        except Exception as exc:
            results[f"{dtype}, sm_{capability}"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    return results


@pytest.fixture(scope="module")
def interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_kernels_match_float64_under_the_interpreter(interpreted):
    planted = interpreted.pop("planted wrong adapter (must fail)")
    assert -planted > 1, "the check did not catch the neighbour's adapter"
    assert len(interpreted) == 10
    failed = {name: error for name, error in interpreted.items() if not error <= 1}
    assert not failed, failed


def test_triton_kernels_compile_for_gpus_without_a_gpu():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--compile"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"compile run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results and all(error is None for error in results.values()), results


if __name__ == "__main__":
    print(json.dumps(compile_for_gpus() if sys.argv[1:] == ["--compile"] else interpreter_results()))
