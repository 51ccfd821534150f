"""`kvforge_cpp::inverse_cdf`, the sampler's draw on CPU, and `inverse_cdf_row`,
the same draw of one row on the host, against the torch path they replace (float64 cumsum, searchsorted right, clamp, argmax for a token of
probability 0): the same token in every row, bit for bit, on random rows and on
rows built to land exactly on the kernel's edges (a threshold equal to a kept
sum, u = 0 before masked tokens, a threshold at the very top)."""

from __future__ import annotations

import pytest
import torch

from kvforge.engine import sampler
from kvforge.kernels import build

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"kvforge's C++ library cannot be built here: {build.missing_tools()}", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def library():
    build.load()


def torch_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path: what the kernel must reproduce."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    chosen = chosen.clamp_(max=probs.shape[-1] - 1)
    impossible = probs.gather(1, chosen.unsqueeze(1)).squeeze(1) == 0
    return torch.where(impossible, probs.argmax(dim=-1), chosen)


def kernel_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvforge_cpp.inverse_cdf(probs, u)


def host_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sampler.inverse_cdf_row`, row by row on the arrays (the rejection sampler's host path)."""
    rows, numbers = probs.numpy(), u.numpy()
    return torch.tensor([sampler.inverse_cdf_row(row, number) for row, number in zip(rows, numbers)])


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 63), (8, 64), (13, 65), (64, 1000), (17, 16384)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_draw_the_torch_paths_tokens(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed * 100 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * (1 + 4 * torch.rand(rows, 1, generator=g))
    # some rows cut like top-k: most of their tokens at probability 0
    cut = torch.rand(rows, vocab, generator=g) < 0.7
    cut[::2] = False
    cut[:, 0] = False  # every row keeps a token
    probs = torch.softmax(logits.masked_fill(cut, float("-inf")), dim=-1)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    assert torch.equal(kernel_draw(probs, u), torch_draw(probs, u))
    assert torch.equal(host_draw(probs, u), torch_draw(probs, u))


def test_a_threshold_equal_to_a_kept_sum_takes_the_next_stretch():
    # 128 tokens of 2^-7 each: every cumulative sum is exact, and u = 1/2 puts the
    # threshold exactly on the 64th sum, the first one the kernel keeps; the token
    # is the first sum strictly above it, 64, in the second stretch.
    probs = torch.full((1, 128), 2.0**-7)
    u = torch.tensor([0.5], dtype=torch.float64)
    assert kernel_draw(probs, u).tolist() == torch_draw(probs, u).tolist() == host_draw(probs, u).tolist() == [64]


def test_u_zero_skips_tokens_of_probability_zero():
    # Strictly above 0: the first token with any probability, not token 0.
    probs = torch.tensor([[0.0, 0.0, 0.1, 0.9]])
    u = torch.tensor([0.0], dtype=torch.float64)
    assert kernel_draw(probs, u).tolist() == torch_draw(probs, u).tolist() == host_draw(probs, u).tolist() == [2]


def test_a_threshold_at_the_top_falls_back_to_the_argmax_when_the_last_token_is_masked():
    # u = 1 (beyond what the sampler draws) puts the threshold on the total: no sum
    # exceeds it, the last token is taken, and at probability 0 the row's argmax.
    probs = torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    u = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert kernel_draw(probs, u).tolist() == torch_draw(probs, u).tolist() == host_draw(probs, u).tolist() == [1, 3]


def test_two_threads_draw_what_one_does():
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(37, 3000, generator=g), dim=-1)
    u = torch.rand(37, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel_draw(probs, u)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, torch_draw(probs, u))


@pytest.mark.parametrize("probs,u,message", [
    (torch.rand(2, 5, dtype=torch.float64), torch.rand(2, dtype=torch.float64), "contiguous float32"),
    (torch.rand(5, 2).t(), torch.rand(2, dtype=torch.float64), "contiguous float32"),
    (torch.rand(2, 5), torch.rand(3, dtype=torch.float64), "one number per row"),
    (torch.rand(2, 5), torch.rand(2), "float64"),
])
def test_bad_inputs_are_refused_with_what_was_expected(probs, u, message):
    with pytest.raises(RuntimeError, match=message):
        kernel_draw(probs, u)


def test_the_sampler_takes_the_kernel_on_cpu_and_draws_the_same_tokens(monkeypatch):
    g = torch.Generator().manual_seed(9)
    probs = torch.softmax(torch.randn(9, 500, generator=g), dim=-1)
    u = torch.rand(9, generator=g, dtype=torch.float64)
    assert sampler.compiled_draw_ready(probs, u)
    calls = []
    real = torch.ops.kvforge_cpp.inverse_cdf

    class Ops:  # count the kernel's calls through the sampler
        @staticmethod
        def inverse_cdf(*args):
            calls.append(1)
            return real(*args)

    monkeypatch.setattr(torch.ops, "kvforge_cpp", Ops)
    with_kernel = sampler.inverse_cdf(probs, u)
    assert calls == [1]
    monkeypatch.setattr(sampler, "compiled_draw_ready", lambda probs, u: False)
    assert torch.equal(with_kernel, sampler.inverse_cdf(probs, u))
    assert calls == [1]
