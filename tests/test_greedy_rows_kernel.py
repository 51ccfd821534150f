"""`kvforge_cpp::greedy_rows`, a plain step's finiteness check and greedy tokens
in one call, against a float64 reference: each row's first maximum (numpy's
argmax of the row in float64, the index torch's argmax gives), or -1 for a row
with a NaN or an infinity anywhere. On random rows, rows of ties and signed
zeros, a non-finite entry at every position of a row (the sixteen-wide runs, the
tail past them, the first and last entry), on every instruction-set path
(capped with KVFORGE_CPP_ISA) and on two threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge.kernels import build

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"kvforge's C++ library cannot be built here: {build.missing_tools()}", allow_module_level=True)

ISA_LEVELS = ("baseline", "avx2")  # the kernel's two paths (avx512 runs the avx2 one)
SIZES = [(1, 1), (2, 15), (3, 16), (4, 17), (5, 33), (2, 1000), (3, 1024), (2, 16384 + 5)]


@pytest.fixture(autouse=True, scope="module")
def library():
    build.load()


@pytest.fixture(params=ISA_LEVELS)
def isa(request, monkeypatch):
    monkeypatch.setenv("KVFORGE_CPP_ISA", request.param)
    return request.param


def reference(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum in float64, or -1 for a row that is not all finite."""
    rows = logits.double().numpy()
    return [int(row.argmax()) if np.isfinite(row).all() else -1 for row in rows]


def kernel(logits: torch.Tensor) -> list[int]:
    return torch.ops.kvforge_cpp.greedy_rows(logits)


@pytest.mark.parametrize("rows,vocab", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_give_the_first_maximum(isa, rows, vocab, seed):
    g = torch.Generator().manual_seed(seed * 1000 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * (1 + 30 * torch.rand(rows, 1, generator=g))
    got = kernel(logits)
    assert got == reference(logits)
    assert got == logits.argmax(dim=1).tolist()  # the token the general path's argmax picks


@pytest.mark.parametrize("rows,vocab", SIZES)
def test_ties_and_signed_zeros_give_the_first_of_them(isa, rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    rounded = (torch.randn(rows, vocab, generator=g) * 1.5).round()  # many equal maxima
    zeros = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, -0.0, 0.0)  # a maximum of -0.0 and 0.0
    negative = -(torch.rand(rows, vocab, generator=g) + 1)
    negative[:, torch.randint(vocab, (1,), generator=g)] = -1e-30  # tiny and negative
    for logits in (rounded, zeros, negative, torch.full((rows, vocab), -3.4e38)):
        assert kernel(logits) == reference(logits) == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 40, 1024])
def test_a_nan_or_infinity_anywhere_marks_its_row_alone(isa, vocab):
    g = torch.Generator().manual_seed(vocab)
    base = torch.randn(3, vocab, generator=g)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for position in sorted({0, vocab // 2, vocab - 1, min(vocab - 1, 16), min(vocab - 1, 15)}):
            logits = base.clone()
            logits[1, position] = bad
            got = kernel(logits)
            assert got == reference(logits), (bad, position)
            assert got[1] == -1 and got[0] != -1 and got[2] != -1


def test_a_row_of_the_largest_finite_floats_is_finite(isa):
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, -big, big], [-big, -big, -big]])
    assert kernel(logits) == reference(logits) == [0, 0]


def test_two_threads_give_what_one_does():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 5000, generator=g)
    logits[7, 4999] = float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel(logits)
    finally:
        torch.set_num_threads(threads)
    assert two == reference(logits)


@pytest.mark.parametrize("logits,message", [
    (torch.rand(2, 5, dtype=torch.float64), "contiguous float32"),
    (torch.rand(2, 5).bfloat16(), "contiguous float32"),
    (torch.rand(5, 2).t(), "not contiguous"),
    (torch.rand(2, 0), "vocab > 0"),
    (torch.rand(5), "contiguous float32"),
])
def test_bad_inputs_are_refused_with_what_was_expected(logits, message):
    with pytest.raises(RuntimeError, match=message):
        kernel(logits)
