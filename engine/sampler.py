"""Pick the next token of every sampled row at once.

Order of operations (vLLM's): `logit_bias` added, EOS/stop-token masking
for `min_tokens`, penalties, the structured-output grammar mask (`mask`, last, so no penalty can
bring back a token the grammar forbids), then greedy rows take the argmax; the others are divided by their
temperature, cut by top-k, top-p and min-p, and sampled. Log-probabilities are
those of the model's raw distribution (before any processing).

Sampling inverts the CDF: one uniform number `u` per row picks the first token
whose cumulative probability exceeds `u`, so a row costs one random draw, not
one per vocabulary entry. A seeded request draws its `u` from its own
`torch.Generator`, so its tokens do not depend on what shares its batch.

On CPU, once kvforge's C++ library is loaded (every CPU model with the default
kernels loads it), one call of `kvforge_cpp::sample_rows` does a batch's
temperature, top-k, top-p, min-p and draw (kernels/sample_rows.cpp): the same
definition in float64 sums, so the same token except where `u` or `top_p` falls
within rounding of a boundary. Elsewhere the tensor ops below run it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvforge.kernels import build as kernel_library

from .request import Request

NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """`token_ids` int64 `[N]`. With logprobs asked by any row: `sampled_logprobs`
    float32 `[N]` and the `top_ids` / `top_logprobs` `[N, k]` of the largest ask."""

    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Stateless apart from the generator used by unseeded rows."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self._cdf: torch.Tensor | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        """The stream for unseeded rows, one per device so noise is drawn where it is used."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def cdf_buffer(self, probs: torch.Tensor) -> torch.Tensor | None:
        """A float64 CDF buffer kept across steps on CPU: a fresh one each step costs
        page faults comparable to the cumsum itself. Grows to the largest batch seen."""
        if probs.device.type != "cpu":
            return None  # device caching allocators already reuse memory
        rows, vocab = probs.shape
        if self._cdf is None or self._cdf.shape[1] != vocab or self._cdf.shape[0] < rows:
            self._cdf = torch.empty(rows, vocab, dtype=torch.float64)
        return self._cdf[:rows]

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request], mask=None) -> SamplerOutput:
        return self.sample(logits, requests, mask)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request], mask=None) -> SamplerOutput:
        """`logits` float32 `[N, vocab]`, row `i` belonging to `requests[i]`; `mask`, if
        given, edits the processed logits in place (the grammars' bitmasks)."""
        output = SamplerOutput(token_ids=self.draw(processed_logits(logits, requests, mask), requests))
        wanted = [r.params.logprobs for r in requests if r.params.logprobs is not None]
        if wanted:
            output.sampled_logprobs, output.top_ids, output.top_logprobs = raw_logprobs(logits, output.token_ids,
                                                                                        max(wanted))
        return output

    def draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """int64 `[N]`: each row's token from `processed_logits` (rows needing no
        processing may be passed as they are): the argmax of greedy rows, a draw
        from `sampling_probs` for the others."""
        params = [r.params for r in requests]
        device = logits.device
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):  # decided on the host (no device sync)
            return row_argmax(logits)
        u = uniforms(requests, self.generator(device), device)
        if compiled_sample_ready(logits, u):  # every row in one call, greedy ones at temperature 0
            return torch.tensor(torch.ops.kvforge_cpp.sample_rows(logits, *row_settings(params), u))
        probs = sampling_probs(logits, params)
        buffer = None if compiled_draw_ready(probs, u) else self.cdf_buffer(probs)  # the kernel needs none
        sampled = inverse_cdf(probs, u, buffer)
        if not any(greedy_rows):
            return sampled
        return torch.where(torch.tensor(greedy_rows, device=device), row_argmax(logits), sampled)


def processed_logits(logits: torch.Tensor, requests: Sequence[Request], mask=None) -> torch.Tensor:
    """float32 logits after each request's `logit_bias`, `min_tokens` masking and
    penalties, which depend on each row's output so far (a copy only when something
    edits them), then `mask` (a callable editing them in place: the grammars'
    bitmasks). Greedy rows take the argmax of these."""
    logits = logits.float()
    banned = stop_token_entries(requests, logits.shape[-1])
    uses_penalties = any(r.params.uses_penalties for r in requests)
    biased = any(r.params.logit_bias for r in requests)
    if banned[0] or uses_penalties or biased or mask is not None:  # copy only when something edits the logits
        logits = logits.clone()
        if biased:
            add_logit_bias(logits, requests)
        if banned[0]:
            logits[banned] = NEG_INF
        apply_penalties(logits, requests)
        if mask is not None:
            mask(logits)
    return logits


def sampling_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """The distribution sampled rows draw from: `processed_logits` divided by the
    temperature, cut by top-k, top-p and min-p, softmaxed (greedy rows: temperature 1)."""
    temperatures = [p.temperature if not p.greedy else 1.0 for p in params]
    scaled = logits
    if any(t != 1.0 for t in temperatures):  # x / 1.0 == x exactly: skip the pass
        temperature = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype)
        scaled = logits / temperature.unsqueeze(1)
    scaled = apply_top_k_top_p_min_p(scaled, params)
    return torch.softmax(scaled, dim=-1)


def raw_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(chosen, top_ids, top_logprobs)` of the model's raw distribution: the logprob
    of `token_ids[i]` in row i, and each row's `k` most likely tokens."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_logprobs


def logprob_record(k: int, top_ids: torch.Tensor, top_logprobs: torch.Tensor, chosen: torch.Tensor,
                   token: int) -> dict[int, float]:
    """One emitted token's `{token id: logprob}`: the `k` most likely, and the chosen one."""
    record = dict(zip(top_ids[:k].tolist(), top_logprobs[:k].tolist()))
    record[token] = float(chosen)
    return record


LARGEST_INT = 2**62  # a top_k past it keeps every token all the same
LARGEST_FLOAT = 1e308  # a temperature or penalty past float32's range is float32's infinity either way


def row_settings(params: Sequence) -> tuple[list[float], list[int], list[float], list[float]]:
    """`(temperature, top_k, top_p, min_p)`, one entry per row, as
    `kvforge_cpp::sample_rows` takes them (64-bit numbers: a larger valid setting
    is bounded where bounding it changes nothing): temperature 0 for a greedy row."""
    return ([0.0 if p.greedy else float(min(p.temperature, LARGEST_FLOAT)) for p in params],
            [min(int(p.top_k), LARGEST_INT) for p in params], [float(p.top_p) for p in params],
            [float(p.min_p) for p in params])


def burst_uniforms(requests: Sequence[Request], generator: torch.Generator,
                   steps: int) -> tuple[torch.Tensor, Callable[[int], None]] | None:
    """float64 `[steps, N]` on the CPU: row s holds what the s-th of `steps` calls of
    `uniforms` would draw (CPU generators draw a long run as they draw its pieces in
    turn), and `keep(passes)`, which leaves every generator as the first `passes`
    of those calls would, for a burst that ran fewer. None when two rows share a
    generator (their draws interleave)."""
    seeded = [(row, r.generator) for row, r in enumerate(requests) if r.generator is not None and not r.params.greedy]
    generators = [generator] + [g for _, g in seeded]
    if len({id(g) for g in generators}) < len(generators):
        return None
    states = [g.get_state() for g in generators]
    u = torch.rand(steps, len(requests), generator=generator, dtype=torch.float64)
    for row, own in seeded:
        u[:, row] = torch.rand(steps, generator=own, dtype=torch.float64)

    def keep(passes: int) -> None:
        if passes == steps:
            return
        for g, state in zip(generators, states):
            g.set_state(state)
        torch.rand(passes * len(requests), generator=generator, dtype=torch.float64)
        for _, own in seeded:
            torch.rand(passes, generator=own, dtype=torch.float64)

    return u, keep


def uniforms(requests: Sequence[Request], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """float64 `U[0, 1)` per row: one batched draw for unseeded rows, one draw per
    seeded row from its own (CPU) generator (a loop over requests, not tokens)."""
    u = torch.rand(len(requests), generator=generator, device=device, dtype=torch.float64)
    seeded = [(row, r.generator) for row, r in enumerate(requests) if r.generator is not None and not r.params.greedy]
    if not seeded:
        return u
    own = [torch.rand(1, generator=g, dtype=torch.float64) for _, g in seeded]
    own = own[0] if len(own) == 1 else torch.cat(own)
    if len(seeded) == len(requests):  # every row draws its own (the batched draw above still advances the stream)
        return own.to(device)
    u[[row for row, _ in seeded]] = own.to(device)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first token of each row whose cumulative probability exceeds `u * total`.
    `out`, if given, is a float64 buffer of `probs`' shape to hold the CDF.

    On CPU, once kvforge's C++ library is loaded (every CPU model with the default
    kernels loads it), `kvforge_cpp::inverse_cdf` draws the same tokens from the
    same float64 sums without writing the CDF (kernels/inverse_cdf.cpp)."""
    if compiled_draw_ready(probs, u):
        return torch.ops.kvforge_cpp.inverse_cdf(probs, u)
    # Same sums as `.double().cumsum`, one pass less.
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64, out=out) if out is not None else \
        torch.cumsum(probs, dim=-1, dtype=torch.float64)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    chosen = chosen.clamp_(max=probs.shape[-1] - 1)
    # Rounding at the very top of the CDF could land on a masked token: take the mode then.
    impossible = probs.gather(1, chosen.unsqueeze(1)).squeeze(1) == 0
    if probs.device.type == "cpu" and not bool(impossible.any()):  # no sync to avoid on CPU
        return chosen  # the usual case: skip a full-vocabulary argmax
    return torch.where(impossible, probs.argmax(dim=-1), chosen)


def inverse_cdf_row(probs: np.ndarray, u: float) -> int:
    """`inverse_cdf` of one float32 row on the host, with the same sums and
    comparisons (float64 running sums left to right, the first above `u * total`,
    the last token when none is, the row's first maximum for a token of probability
    0), so the same token: for a caller that already holds the row as an array,
    where a torch call costs more than the draw."""
    cdf = np.cumsum(probs, dtype=np.float64)
    token = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.shape[-1] - 1)
    return int(np.argmax(probs)) if probs[token] == 0 else token


def compiled_sample_ready(logits: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether `kvforge_cpp::sample_rows` samples these rows: where the inverse-CDF
    kernel can draw them (`compiled_draw_ready`)."""
    return compiled_draw_ready(logits, u)


def compiled_draw_ready(probs: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether `kvforge_cpp::inverse_cdf` can draw these rows: CPU float32 rows, and
    the library already loaded (the sampler never starts a build of its own)."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or not probs.is_contiguous():
        return False
    return probs.shape[-1] > 0 and u.dtype == torch.float64 and kernel_library.is_loaded()


def add_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Add each request's `logit_bias` to its row, in one indexed add over the batch."""
    rows, cols, biases = [], [], []
    for row, request in enumerate(requests):
        for token, bias in (request.params.logit_bias or {}).items():
            rows.append(row)
            cols.append(token)
            biases.append(bias)
    # (row, token) pairs never repeat (a dict's keys), so a plain indexed add is exact
    logits[rows, cols] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def mask_stop_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Forbid EOS and stop token ids while a request has fewer than `min_tokens`."""
    rows, cols = stop_token_entries(requests, logits.shape[-1])
    if rows:
        logits[rows, cols] = NEG_INF


def stop_token_entries(requests: Sequence[Request], vocab: int) -> tuple[list[int], list[int]]:
    """`(rows, cols)` of the EOS and stop token ids forbidden by `min_tokens`."""
    rows, cols = [], []
    for row, request in enumerate(requests):
        if len(request.output_token_ids) >= request.params.min_tokens:
            continue
        banned = set(request.params.stop_token_ids)
        if request.eos_token_id is not None and not request.params.ignore_eos:
            banned.add(request.eos_token_id)
        for token in banned:
            if 0 <= token < vocab:
                rows.append(row)
                cols.append(token)
    return rows, cols


def token_counts(sequences: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[N, vocab]` int counts of each token in each sequence, built with one scatter."""
    width = max((len(s) for s in sequences), default=0)
    padded = torch.full((len(sequences), width), vocab, dtype=torch.int64)
    for row, tokens in enumerate(sequences):
        if tokens:
            padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(sequences), vocab + 1, dtype=torch.int64)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab].to(device)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition (prompt and output), presence and frequency (output) penalties."""
    if not any(r.params.uses_penalties for r in requests):
        return
    vocab, device = logits.shape[-1], logits.device
    params = [r.params for r in requests]
    output_counts = token_counts([r.output_token_ids for r in requests], vocab, device)
    if any(p.repetition_penalty != 1 for p in params):
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        seen = (token_counts([r.prompt_token_ids for r in requests], vocab, device) > 0) | (output_counts > 0)
        # A penalty outside float32's range is inf or 0 there: 0 * inf, 0 / 0 would be NaN and
        # a product or quotient past the range an infinity, which would ban (or force) a token
        # where the penalty should only make it less (or more) likely. Zeros stay, results stop
        # at the finite range, and tokens already banned (-inf) stay banned.
        finite = torch.finfo(logits.dtype)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        penalized = torch.where(logits == 0, logits, penalized).clamp(finite.min, finite.max)
        logits.copy_(torch.where(seen & (logits != NEG_INF), penalized, logits))
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    logits -= frequency * output_counts + presence * (output_counts > 0)


CANDIDATES = 256
"""Top-k/top-p look at this many most likely tokens (`topk`, far cheaper than a
full sort of a large vocabulary) and fall back to a full sort only when a row's
nucleus might reach beyond them."""


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, top-p nucleus or min-p floor.
    At least the most likely token always survives."""
    if any(0 < p.top_k < logits.shape[-1] or p.top_p < 1 for p in params):
        logits = top_k_top_p(logits, params)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = logits.softmax(dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def top_k_top_p(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Top-k, then top-p within what top-k kept (renormalized), as vLLM does. The
    passes a batch does not need (no row with top-k, every row truncated: the
    common single request) are left out; the values are the same either way."""
    device, vocab = logits.device, logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    bounded = [k < vocab for k in top_k]
    some_bounded, all_bounded = any(bounded), all(bounded)
    width = max([CANDIDATES] + [k for k, b in zip(top_k, bounded) if b])
    width = vocab if 2 * width > vocab else width  # a partial topk only pays off for a few candidates
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    total = None if all_bounded else logits.logsumexp(dim=-1, keepdim=True)  # rows without top-k normalize by it
    if width == vocab:
        values, order = logits.sort(dim=-1, descending=True)
    else:
        values, order = logits.topk(width, dim=-1)
        if not all_bounded:  # a row without top-k whose nucleus may pass the candidates needs the full sort
            mass = (values.logsumexp(dim=-1, keepdim=True) - total).exp().squeeze(1)
            open_rows = torch.tensor([not b for b in bounded], device=device)
            if bool((open_rows & (top_p < 1) & (mass < top_p + 1e-4)).any()):
                width = vocab
                values, order = logits.sort(dim=-1, descending=True)
    if some_bounded:
        rank = torch.arange(width, device=device).unsqueeze(0)
        drop = rank >= torch.tensor(top_k, device=device).unsqueeze(1)
        kept = values.masked_fill(drop, NEG_INF)
        # Probabilities within top-k where it applies, else over the whole vocabulary.
        norm = kept.logsumexp(dim=-1, keepdim=True)
        if not all_bounded:
            norm = torch.where(torch.tensor(bounded, device=device).unsqueeze(1), norm, total)
    else:
        drop, kept, norm = None, values, total
    probs = (kept - norm).exp()
    # Mass of the tokens strictly before this one: drop a token once that already reaches p.
    beyond = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop = beyond if drop is None else drop | beyond
    drop[:, 0] = False
    result = torch.full_like(logits, NEG_INF).scatter(1, order, values.masked_fill(drop, NEG_INF))
    truncating = [b or p.top_p < 1 for b, p in zip(bounded, params)]
    if all(truncating):
        return result
    return torch.where(torch.tensor(truncating, device=device).unsqueeze(1), result, logits)


def row_argmax(x: torch.Tensor, block: int = 256, direct_below: int = 1 << 15) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-D tensor, the same indices (first maximum,
    NaN counting as the maximum), in two levels: the maximum of each run of
    `block` entries, then the argmax inside the winning run. On a CPU torch's
    argmax does not vectorise and its `amax` does, so over a large vocabulary the
    two levels are several times faster (docs/benchmarks.md, "Sampling"). Below
    `direct_below` entries their half dozen ops cost more than they save (a small
    model's vocabulary), so `argmax` runs as it is."""
    rows, width = x.shape
    if width <= block or rows == 0 or x.numel() < direct_below:
        return x.argmax(dim=-1)
    full = width // block * block
    maxima = x[:, :full].reshape(rows, -1, block).amax(dim=-1)
    if full < width:
        maxima = torch.cat((maxima, x[:, full:].amax(dim=-1, keepdim=True)), dim=1)
    start = maxima.argmax(dim=-1) * block
    # Past the end, a short last run repeats the last entry: after its true position, so never first.
    index = (start[:, None] + torch.arange(block, device=x.device)[None, :]).clamp_(max=width - 1)
    return start + x.gather(1, index).argmax(dim=-1)
