"""Verify draft tokens against the target model, keeping its output distribution exact.

A request with `d` drafts brings `d + 1` rows of target logits: row `j` is the
target's next-token distribution after the request's output plus its first `j`
drafts. Each row is processed exactly as the sampler would at that position
(min_tokens masking and penalties see the earlier drafts as output; then
temperature, top-k, top-p, min-p), giving `p_j`.

* Greedy rows accept drafts while each equals the target's argmax, then emit
  the target's argmax at the first mismatch (or after the last draft): the
  tokens decoding without speculation would produce.
* Sampled rows use rejection sampling (Leviathan et al., 2023; Chen et al.,
  2023): draft `x_j` with draft probability `q_j(x_j)` is accepted with
  probability `min(1, p_j(x_j) / q_j(x_j))`; at the first rejection a token is
  drawn from `normalize(max(p_j - q_j, 0))`; if all `d` are accepted, a bonus
  token is drawn from `p_d`. Every emitted token is then distributed exactly as
  the target's. A deterministic proposer (no probs) has `q_j` one-hot on `x_j`.

It runs as tensor ops over `[requests, d + 1, vocab]`, except on CPU with
deterministic proposers, where each request's accepts and final draw are read
off on the host from the same distributions and random numbers (the same
tokens, for a fraction of the torch calls). Random numbers come from the
request's own generator when it has a seed (so its output does not depend on
what shares the batch), else from the engine's stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import Request
from .sampler import Sampler, inverse_cdf, inverse_cdf_row, processed_logits, row_argmax, sampling_probs
from .sampling_params import SamplingParams


@dataclass
class _Position:
    """A request as it would stand after its first j drafts were accepted: what
    the logits processors read (`min_tokens` counts, penalties)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


@dataclass
class Verified:
    """Per request: the emitted tokens (accepted drafts, then the target's token)."""

    token_ids: list[list[int]]

    @property
    def num_accepted(self) -> list[int]:
        return [len(tokens) - 1 for tokens in self.token_ids]


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries of a bool `[R, k]` mask are True."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def plain_greedy(request: Request) -> bool:
    """Greedy, and nothing edits its logits at any draft position (no logit bias,
    penalties, or `min_tokens` still to reach: drafts only lengthen the output)."""
    params = request.params
    return (params.greedy and not params.logit_bias and not params.uses_penalties
            and len(request.output_token_ids) >= params.min_tokens)


def verify_plain_greedy(logits: torch.Tensor, drafts: Sequence[list[int]]) -> Verified:
    """Greedy verification when every row is the raw logits (`plain_greedy`): one
    argmax over all rows and one copy to the host, then `accept_greedy`."""
    return accept_greedy(row_argmax(logits.float()).tolist(), drafts)


def accept_greedy(target: Sequence[int], drafts: Sequence[list[int]]) -> Verified:
    """Greedy verification from the target's token at every row (request after
    request, `len(draft) + 1` rows each): the draft-by-draft compare on at most k
    ints per request; no per-position bookkeeping."""
    emitted, start = [], 0
    for draft in drafts:
        row = target[start: start + len(draft) + 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == row[accepted]:
            accepted += 1
        emitted.append(draft[:accepted] + [row[accepted]])
        start += len(draft) + 1
    return Verified(emitted)


def _positions(requests: Sequence[Request], drafts: Sequence[list[int]]) -> list:
    """What the logits processors read at every verified row: each request, then
    as it would stand after each of its drafts (`_Position`)."""
    positions: list = []
    for request, draft in zip(requests, drafts):
        positions.append(request)
        positions += [_Position(request.params, request.prompt_token_ids, request.output_token_ids + draft[:j],
                                request.eos_token_id) for j in range(1, len(draft) + 1)]
    return positions


class RejectionSampler:
    """Verifies drafts; shares the sampler's engine-wide random stream."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]],
                 draft_probs: Sequence[torch.Tensor | None], mask=None) -> Verified:
        """`logits` float32 `[sum(len(d) + 1), vocab]`: request after request, its
        rows for positions 0..d. Every request has at least one draft. `mask`, if
        given, edits the processed logits in place (the grammars' bitmasks)."""
        if mask is None and all(plain_greedy(r) for r in requests):
            return verify_plain_greedy(logits, drafts)
        if logits.device.type == "cpu" and all(given is None for given in draft_probs):
            return self._verify_one_hot(logits, requests, drafts, mask)
        return self._verify_batched(logits, requests, drafts, draft_probs, mask)

    def _verify_one_hot(self, logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]],
                        mask) -> Verified:
        """`__call__` on CPU when every proposer is deterministic (`q` one-hot): the
        processed rows and the sampled rows' distributions are computed as in
        `_verify_batched`, with the same random numbers (`_uniforms`), then each
        request's accepts, residual and final draw are read off on the host, where
        the batched path's gathers over `[R, k + 1, vocab]` cost a torch call each
        (a sampled verification step at batch 1 spent longer in them than in the
        model's forward). The tokens are the batched path's."""
        positions = _positions(requests, drafts)
        processed = processed_logits(logits, positions, mask)
        greedy = [r.params.greedy for r in requests]
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        emitted: list[list[int] | None] = [None] * len(requests)
        if any(greedy):
            target = row_argmax(processed).tolist()
            for i, draft in enumerate(drafts):
                if greedy[i]:
                    emitted[i] = accept_greedy(target[starts[i]: starts[i + 1]], [draft]).token_ids[0]
        if not all(greedy):
            probs = sampling_probs(processed, [p.params for p in positions])
            u = self._uniforms(requests, drafts, max(len(d) for d in drafts), logits.device)
            p, uniform = probs.numpy(), u.numpy()
            for i, draft in enumerate(drafts):
                if greedy[i]:
                    continue
                row, accepted = starts[i], 0
                # u < p(x) / q(x) with q(x) = 1: accepted while the draft is likely enough
                while accepted < len(draft) and uniform[i, accepted] < p[row + accepted, draft[accepted]]:
                    accepted += 1
                residual = p[row + accepted]
                if accepted < len(draft):  # p - q: p with the rejected draft taken out
                    residual = residual.copy()
                    residual[draft[accepted]] = 0
                    if not residual.sum() > 0:  # p == q: reached only by rounding; draw from p
                        residual = p[row + accepted]
                emitted[i] = draft[:accepted] + [inverse_cdf_row(residual, uniform[i, len(draft)])]
        return Verified(emitted)

    def _verify_batched(self, logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]],
                        draft_probs: Sequence[torch.Tensor | None], mask) -> Verified:
        """`__call__` as tensor ops over `[R, k + 1, vocab]`, on any device and proposer."""
        device, vocab = logits.device, logits.shape[-1]
        counts = torch.tensor([len(d) + 1 for d in drafts], dtype=torch.int64)
        num_drafts = (counts - 1).to(device)
        k = int(counts.max()) - 1
        positions = _positions(requests, drafts)
        processed = processed_logits(logits, positions, mask)
        # index[i, j]: the flat row of request i at position j (padding repeats its last row).
        steps = torch.arange(k + 1)
        index = ((torch.cumsum(counts, 0) - counts).unsqueeze(1) + torch.minimum(steps, counts.unsqueeze(1) - 1))
        index = index.to(device)
        draft = torch.zeros(len(drafts), k, dtype=torch.int64)
        for i, tokens in enumerate(drafts):
            draft[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        draft = draft.to(device)
        has_draft = torch.arange(k, device=device).unsqueeze(0) < num_drafts.unsqueeze(1)
        greedy = [r.params.greedy for r in requests]
        accepted = final = None
        if any(greedy):
            target = row_argmax(processed)[index]  # [R, k + 1]
            accepted = leading_true((draft == target[:, :k]) & has_draft)
            final = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
        if not all(greedy):
            probs = sampling_probs(processed, [p.params for p in positions])[index]  # [R, k + 1, vocab]
            sampled_accepted, sampled_final = self._reject(probs, draft, has_draft, num_drafts, requests, drafts,
                                                           draft_probs, vocab)
            if accepted is None:
                accepted, final = sampled_accepted, sampled_final
            else:
                is_greedy = torch.tensor(greedy, device=device)
                accepted = torch.where(is_greedy, accepted, sampled_accepted)
                final = torch.where(is_greedy, final, sampled_final)
        emitted = [tokens[:a] + [f] for tokens, a, f in zip(drafts, accepted.tolist(), final.tolist())]
        return Verified(emitted)

    def _reject(self, probs, draft, has_draft, num_drafts, requests, drafts, draft_probs, vocab):
        """`(accepted, final)` of rejection sampling for every row (greedy ones ignored)."""
        rows, k = draft.shape
        device = probs.device
        at = torch.arange(rows, device=device)
        p_draft = probs[:, :k].gather(2, draft.unsqueeze(2)).squeeze(2)
        u = self._uniforms(requests, drafts, k, device)
        if all(given is None for given in draft_probs):
            # Deterministic proposers only: q is one-hot, so q(x) = 1 and p - q is p with
            # the draft zeroed; no [rows, k, vocab] tensor of draft distributions is built.
            accepted = leading_true((u[:, :k] < p_draft) & has_draft)
            p_at = probs[at, accepted]
            rejected = accepted < num_drafts
            residual = p_at.clone()
            residual[at[rejected], draft[at, accepted.clamp(max=k - 1)][rejected]] = 0
        else:
            q = torch.zeros(rows, k, vocab, device=device, dtype=probs.dtype)
            for i, (tokens, given) in enumerate(zip(drafts, draft_probs)):
                if given is None:  # a deterministic proposer: one-hot on its draft
                    q[i, torch.arange(len(tokens), device=device), draft[i, : len(tokens)]] = 1
                else:
                    q[i, : len(tokens)] = given.to(device=device, dtype=probs.dtype)
            q_draft = q.gather(2, draft.unsqueeze(2)).squeeze(2)
            # u < p/q, written without the division: q > 0 at every real draft (checked by the Drafter).
            accepted = leading_true((u[:, :k] * q_draft < p_draft) & has_draft)
            p_at = probs[at, accepted]
            q_at = q[at, accepted.clamp(max=k - 1)] * (accepted < num_drafts).unsqueeze(1)
            residual = (p_at - q_at).clamp_(min=0)
        # p == q leaves nothing; a rejection then had probability 0, so this row never
        # reaches here except by rounding: draw from p.
        residual = torch.where((residual.sum(dim=1, keepdim=True) > 0), residual, p_at)
        final = inverse_cdf(residual, u.gather(1, num_drafts.unsqueeze(1)).squeeze(1))
        return accepted, final

    def _uniforms(self, requests, drafts, k: int, device) -> torch.Tensor:
        """float64 `[R, k + 1]`: row i's first `d_i` entries decide its accepts, entry
        `d_i` draws its final token. A seeded request draws all of them from its own
        generator, so its output is reproducible whatever shares the batch."""
        u = torch.rand(len(requests), k + 1, generator=self.sampler.generator(device), device=device,
                       dtype=torch.float64)
        for i, (request, tokens) in enumerate(zip(requests, drafts)):
            if request.generator is not None and not request.params.greedy:
                u[i, : len(tokens) + 1] = torch.rand(len(tokens) + 1, generator=request.generator,
                                                     dtype=torch.float64).to(device)
        return u
