"""`kvforge_cpp::sample_rows`, the sampler's whole draw on CPU (temperature,
top-k, top-p, min-p and the inverse CDF in one call), against the definition
computed in float64 one row at a time: the kept tokens and the drawn token on
random rows of every size and shape (flat, peaked, with banned tokens and with
ties), except where u or top_p lies within rounding of a boundary, which the
reference detects and which must stay rare."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvforge import SamplingParams
from kvforge.engine import sampler
from kvforge.engine.request import Request
from kvforge.kernels import build

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"kvforge's C++ library cannot be built here: {build.missing_tools()}", allow_module_level=True)

CLOSE = 1e-5  # relative distance to a boundary the float32 weights cannot resolve


@pytest.fixture(autouse=True, scope="module")
def library():
    build.load()


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    return torch.ops.kvforge_cpp.sample_rows(logits, *sampler.row_settings(params), u)


def reference(row: torch.Tensor, params: SamplingParams, u: float) -> tuple[int | None, np.ndarray]:
    """The definition in float64: the token (None where u, top_p or min_p lies
    within rounding of a boundary) and each token's kept weight (0: dropped)."""
    y = (row / torch.tensor(params.temperature, dtype=torch.float32)).double().numpy()  # float32 division
    vocab = y.shape[0]
    finite = np.isfinite(y)
    weight = np.where(finite, np.exp(y - y[finite].max()), 0.0)
    order = [i for i in np.lexsort((np.arange(vocab), -y)) if finite[i]]  # largest first, ties by index
    if 0 < params.top_k < vocab:
        order = order[:params.top_k]
    ambiguous = False
    if params.top_p < 1:
        target = params.top_p * weight[order].sum()
        sums = np.cumsum(weight[order])
        cut = int(np.argmax(sums >= target)) if (sums >= target).any() else len(order) - 1
        ambiguous = bool(np.abs(sums - target).min() < CLOSE * sums[-1])
        order = order[:cut + 1]
    kept = np.zeros(vocab)
    kept[order] = weight[order]
    if params.min_p > 0:
        ambiguous |= bool((np.abs(kept[kept > 0] - params.min_p) < CLOSE).any())
        kept[kept < params.min_p] = 0.0
    cdf = np.cumsum(kept)
    threshold = u * cdf[-1]
    ambiguous |= bool(np.abs(cdf[kept > 0] - threshold).min() < CLOSE * cdf[-1])
    token = int(np.argmax((cdf > threshold) & (kept > 0)))
    return (None if ambiguous else token), kept


def random_case(rng: random.Random, generator: torch.Generator) -> tuple[torch.Tensor, SamplingParams]:
    vocab = rng.choice([1, 2, 3, 7, 40, 64, 257, 1024, 5000])
    row = torch.randn(vocab, generator=generator) * rng.choice([0.01, 1.0, 10.0])
    if rng.random() < 0.3:
        row = row.round()  # ties
    if rng.random() < 0.3 and vocab > 2:
        row[torch.randint(0, vocab, (vocab // 3,), generator=generator)] = float("-inf")
        row[rng.randrange(vocab)] = 0.5  # at least one token left
    params = SamplingParams(temperature=rng.choice([0.3, 1.0, 2.5]), top_k=rng.choice([0, 1, 5, 300, vocab + 3]),
                            top_p=rng.choice([1.0, 0.95, 0.5, 1e-6]), min_p=rng.choice([0.0, 0.05, 0.5]))
    return row, params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_draw_the_definitions_token(seed):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    checked = 0
    for _ in range(400):
        row, params = random_case(rng, generator)
        u = torch.rand(1, generator=generator, dtype=torch.float64)
        token, kept = reference(row, params, float(u))
        got = sample_rows(row[None].contiguous(), [params], u)[0]
        assert kept[got] > 0, (params, got)  # never a token the definition drops
        if token is not None:
            assert got == token, (row.shape[0], params, float(u))
            checked += 1
    assert checked >= 380  # the rounding cases the reference sets aside stay rare


def test_every_kept_token_is_drawn_in_its_share():
    # Drawn with u spread evenly over [0, 1): each kept token takes its share of the
    # draws, ties at the top-k edge go to the lower indices.
    row = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, 1.0, -1.0, float("-inf")])
    params = SamplingParams(temperature=1.0, top_k=3, min_p=0.0)
    n = 4000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = sample_rows(row.expand(n, -1).contiguous(), [params] * n, u)
    counts = np.bincount(tokens, minlength=8) / n
    share = np.exp([2.0, 1.0, 1.0]) / np.exp([2.0, 1.0, 1.0]).sum()
    assert np.allclose(counts[:3], share, atol=1e-3) and counts[3:].sum() == 0


def test_top_p_and_min_p_on_a_large_vocabulary_keep_the_definitions_tokens():
    generator = torch.Generator().manual_seed(3)
    for scale in (0.05, 1.0, 8.0):  # the nucleus: most of the vocabulary, thousands of tokens, a few
        row = torch.randn(40000, generator=generator) * scale
        for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=2000, top_p=0.5),
                       SamplingParams(temperature=1.3, min_p=0.02)):
            _, kept = reference(row, params, 0.5)
            u = torch.rand(256, generator=generator, dtype=torch.float64)
            tokens = sample_rows(row.expand(256, -1).contiguous(), [params] * 256, u)
            assert all(kept[t] > 0 for t in tokens), (scale, params)
            expected = [reference(row, params, float(x))[0] for x in u[:16]]
            assert [t for t, e in zip(tokens[:16], expected) if e is not None] == [e for e in expected if e is not None]


def test_temperature_zero_is_torch_argmax_with_ties_and_nan():
    rows = torch.tensor([[1.0, 3.0, 3.0, -2.0], [float("-inf"), -5.0, -5.0, -7.0],
                         [0.0, float("nan"), 9.0, float("nan")], [4.0, 4.0, 4.0, 4.0]])
    greedy = SamplingParams(temperature=0)
    assert sample_rows(rows, [greedy] * 4, torch.rand(4, dtype=torch.float64)) == rows.argmax(-1).tolist()


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 3000, generator=generator) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(0.7, 0, 0.9, 0), (1.0, 40, 1.0, 0), (0, 0, 1.0, 0), (1.5, 0, 1.0, 0.1),
                                 (0.9, 20, 0.5, 0), (1.0, 0, 1.0, 0), (0.4, 3000, 0.99, 0.01),
                                 (2.0, 1, 1.0, 0), (1.0, 0, 0.3, 0.3)]]
    u = torch.rand(9, generator=generator, dtype=torch.float64)
    together = sample_rows(logits, params, u)
    torch.set_num_threads(2)
    try:
        assert sample_rows(logits, params, u) == together  # rows split across threads
    finally:
        torch.set_num_threads(1)
    for r in range(9):
        assert sample_rows(logits[r:r + 1], params[r:r + 1], u[r:r + 1]) == [together[r]]
    # a larger vocabulary in between: the buffers a thread keeps grow and must not leak into a smaller row
    sample_rows(torch.randn(2, 70000, generator=generator), params[:2], u[:2])
    assert sample_rows(logits, params, u) == together


def test_the_sampler_draws_through_the_kernel_on_cpu():
    # Sampler.draw with the library loaded: the kernel's tokens, greedy rows beside sampled ones.
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 500, generator=generator)
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=0), dict(top_k=7), dict(min_p=0.2),
                dict(temperature=1.2, seed=3)]
    requests = [Request(f"r{i}", [1], SamplingParams(**s)) for i, s in enumerate(settings)]
    drawn = sampler.Sampler(11).draw(logits, requests)
    u = sampler.uniforms([Request(f"r{i}", [1], SamplingParams(**s)) for i, s in enumerate(settings)],
                         torch.Generator().manual_seed(11), torch.device("cpu"))
    assert drawn.tolist() == sample_rows(logits, [r.params for r in requests], u)
    assert drawn[1] == logits[1].argmax()


@pytest.mark.parametrize("call, message", [
    (lambda x, u: torch.ops.kvforge_cpp.sample_rows(x.double(), [1.0], [0], [1.0], [0.0], u), "float32"),
    (lambda x, u: torch.ops.kvforge_cpp.sample_rows(x, [1.0, 1.0], [0], [1.0], [0.0], u), "one value per row"),
    (lambda x, u: torch.ops.kvforge_cpp.sample_rows(x, [-1.0], [0], [1.0], [0.0], u), "temperature"),
    (lambda x, u: torch.ops.kvforge_cpp.sample_rows(x, [1.0], [0], [1.0], [0.0], u.float()), "float64"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(1, 10), torch.rand(1, dtype=torch.float64))


def test_settings_past_64_bits_draw_as_their_bounded_equals():
    # Valid settings too large for the kernel's 64-bit arguments: top_k past any
    # vocabulary keeps every token, a temperature past float32's range flattens
    # the row as float32's infinity does.
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 300, generator=generator)

    def tokens(**setting):
        requests = [Request(f"r{i}", [1], SamplingParams(seed=i, **setting)) for i in range(4)]
        return sampler.Sampler(0).draw(logits, requests).tolist()

    assert tokens(top_k=10**30) == tokens(top_k=0)
    assert tokens(temperature=10**400) == tokens(temperature=float("inf")) == tokens(temperature=1e39)
    flat = sample_rows(logits[:1].expand(3000, -1).contiguous(), [SamplingParams(temperature=float("inf"))] * 3000,
                       (torch.arange(3000, dtype=torch.float64) + 0.5) / 3000)
    assert np.bincount(flat, minlength=300).tolist() == [10] * 300  # every token alike
