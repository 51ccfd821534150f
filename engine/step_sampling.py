"""One step's logits to each request's tokens.

`StepSampler.sample` sets aside the requests whose logits hold a NaN or an
infinity (sampling them would emit garbage tokens; the scheduler ends them),
picks each other request's logit row (a sample forked this step draws from its
parent's row; a prompt chunk short of the end has none), samples them in one
batch, verifies every speculating request's drafts in another
(`RejectionSampler`), and records the log-probabilities a request asked for.
Rows of requests with structured outputs are masked by their grammars after
the penalties, one row per sampling position (`StructuredOutputs.mask`).
The engine hands the result to `Scheduler.update_from_output`.
"""

from __future__ import annotations

import itertools
import math

import torch

from kvforge.kernels import build as kernel_library

from .metrics import EngineMetrics
from .rejection_sampler import RejectionSampler, accept_greedy
from .request import Request
from .sampler import Sampler, logprob_record, raw_logprobs
from .scheduler_output import SampledTokens, SamplerOutput, ScheduledRequest, SchedulerOutput


class StepSampler:
    """The engine's sampler (seeded by `seed`) and draft verifier; the draft
    counts go to `stats`; `structured_outputs` masks the rows of requests with grammars."""

    def __init__(self, seed: int | None, stats: EngineMetrics, structured_outputs=None):
        self.sampler = Sampler(seed)
        self.verifier = RejectionSampler(self.sampler)
        self.stats = stats
        self.structured_outputs = structured_outputs

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor) -> SamplerOutput:
        """The tokens every sampling request (and every sample forked this step)
        emits, and the requests whose logits are not finite."""
        requests = plain_requests(plan.scheduled, logits)
        tokens = None if requests is None else self._plain_tokens(requests, logits)
        if tokens is not None:
            return SamplerOutput({r.request_id: SampledTokens([t]) for r, t in zip(requests, tokens)})
        if requests is None and plain_greedy_drafts(plan.scheduled, logits):
            verified = self._verify_plain_greedy(plan.scheduled, logits)
            if verified is not None:
                return SamplerOutput(verified)
        entries, logits, non_finite = split_non_finite(plan.scheduled, logits)
        return SamplerOutput(self._sample(entries, logits), non_finite)

    def _plain_tokens(self, requests: list[Request], logits: torch.Tensor) -> list[int] | None:
        """The tokens of a plain step (`plain_requests`); None when a logit is NaN or
        infinite (the general path then sets those requests aside). On CPU one C++
        call (`greedy_rows`) checks finiteness and finds every row's first maximum,
        the greedy token, as torch's argmax."""
        greedy = all(r.params.greedy for r in requests)
        maxima = greedy_rows(logits)
        if maxima is not None:
            if NON_FINITE in maxima:
                return None
            if greedy:
                return maxima
        elif not all_finite(logits):
            return None
        elif greedy and logits.device.type == "cpu":
            return logits.numpy().argmax(axis=1).tolist()  # first maximum, as torch's argmax
        return self.sampler.draw(logits, requests).tolist()

    def _sample(self, entries: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledTokens]:
        rows: list[int] = []
        requests: list[Request] = []
        speculated: list[tuple[ScheduledRequest, int]] = []
        row = 0
        for entry in entries:
            if not entry.samples:
                continue  # a prompt chunk short of the end: no logit rows
            if entry.draft_token_ids:
                speculated.append((entry, row))
                row += 1 + len(entry.draft_token_ids)
                continue
            requests.append(entry.request)
            rows.append(row)
            for fork in entry.forks:  # forks sample from their parent's row
                requests.append(fork)
                rows.append(row)
            row += 1
        sampled = self._verify(speculated, logits) if speculated else {}
        if not requests:
            return sampled
        # rows never decrease: as many as logits, with none shared, means every row in order
        if len(rows) != logits.shape[0] or speculated or (rows and rows[-1] != len(rows) - 1):
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler(logits, requests, self._mask(requests))
        token_ids = result.token_ids.tolist()
        if result.sampled_logprobs is None:
            for request, token in zip(requests, token_ids):
                sampled[request.request_id] = SampledTokens([token])
            return sampled
        for i, request in enumerate(requests):
            records = None
            if request.logprobs is not None:
                records = [logprob_record(request.params.logprobs, result.top_ids[i], result.top_logprobs[i],
                                          result.sampled_logprobs[i], token_ids[i])]
            sampled[request.request_id] = SampledTokens([token_ids[i]], records)
        return sampled

    def _verify_plain_greedy(self, entries: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledTokens] | None:
        """The tokens of a step of greedy decodes, some verifying drafts, whose rows need
        no processing (`plain_greedy_drafts`): one C++ call finds every row's greedy
        token (`greedy_rows`), then the drafts are compared on the host. None when that
        call cannot run or a row is not finite (the general path then sets those
        requests aside)."""
        target = greedy_rows(logits)
        if target is None or NON_FINITE in target:
            return None
        speculating = [e for e in entries if e.draft_token_ids]
        verified = accept_greedy(target, [e.draft_token_ids for e in entries])
        self._count(speculating, verified.num_accepted)
        return {e.request.request_id: SampledTokens(tokens) for e, tokens in zip(entries, verified.token_ids)}

    def _count(self, speculating: list[ScheduledRequest], num_accepted: list[int]) -> None:
        """Add a step's verifications to the draft counters (`num_accepted` may list
        requests without drafts too: they accept none)."""
        self.stats.num_draft_tokens += sum(len(e.draft_token_ids) for e in speculating)
        self.stats.num_accepted_tokens += sum(num_accepted)
        self.stats.num_verifications += len(speculating)

    def _verify(self, speculated: list[tuple[ScheduledRequest, int]], logits: torch.Tensor) -> dict[str, SampledTokens]:
        """Verify the drafts of every speculating request in one batch."""
        flat = [r for entry, first in speculated for r in range(first, first + entry.num_logit_rows)]
        if len(flat) != logits.shape[0]:  # flat rows only increase: as many as logits means all, in order
            logits = logits[torch.tensor(flat, device=logits.device)]
        entries = [entry for entry, _ in speculated]
        requests, drafts = [e.request for e in entries], [e.draft_token_ids for e in entries]
        verified = self.verifier(logits, requests, drafts, [e.draft_probs for e in entries],
                                 self._mask(requests, drafts))
        self._count(entries, verified.num_accepted)
        wanted = [e.request.params.logprobs for e in entries if e.request.logprobs is not None]
        if wanted:  # the raw logprobs of each emitted token, at the row it was drawn from
            starts = itertools.accumulate([e.num_logit_rows for e in entries], initial=0)
            rows = [start + j for start, tokens in zip(starts, verified.token_ids) for j in range(len(tokens))]
            emitted = torch.tensor([t for tokens in verified.token_ids for t in tokens], device=logits.device)
            chosen, top_ids, top_logprobs = raw_logprobs(logits[torch.tensor(rows, device=logits.device)], emitted,
                                                         max(wanted))
        sampled, at = {}, 0
        for entry, tokens in zip(entries, verified.token_ids):
            records = None
            if entry.request.logprobs is not None:
                k = entry.request.params.logprobs
                records = [logprob_record(k, top_ids[at + j], top_logprobs[at + j], chosen[at + j], token)
                           for j, token in enumerate(tokens)]
            sampled[entry.request.request_id] = SampledTokens(tokens, records)
            at += len(tokens)
        return sampled


    def _mask(self, requests: list[Request], drafts: list[list[int]] | None = None):
        """What masks these requests' processed logits by their grammars (one row per
        sampling position, see `StructuredOutputs.mask`); None when none has a grammar."""
        if self.structured_outputs is None or all(r.grammar is None for r in requests):
            return None
        return lambda logits: self.structured_outputs.mask(logits, requests, drafts)


def plain_requests(entries: list[ScheduledRequest], logits: torch.Tensor) -> list[Request] | None:
    """The requests of a step whose every entry samples one row of `logits`, in order,
    that needs no processing (`processed_logits` would return it unchanged) and no
    logprobs: no drafts, forks, grammar, penalties, logit bias or `min_tokens` still
    to reach. None when any entry is not so (the step takes the general path)."""
    if not entries or logits.shape[0] != len(entries) or logits.dtype != torch.float32:
        return None
    requests = []
    for entry in entries:
        if entry.draft_token_ids or not samples_raw_rows(entry):
            return None
        requests.append(entry.request)
    return requests


def samples_raw_rows(entry: ScheduledRequest, penalties: bool = False) -> bool:
    """Whether an entry samples each of its logit rows as it is: it reaches the end of
    its tokens, forks nothing, and asks for no logprobs, grammar, penalties (unless
    `penalties`), logit bias or `min_tokens` still to reach (drafts only lengthen
    the output, so this holds at every draft position too)."""
    request, params = entry.request, entry.request.params
    return (entry.samples and not entry.forks and request.logprobs is None and request.grammar is None
            and (penalties or not params.uses_penalties) and not params.logit_bias
            and len(request.output_token_ids) >= params.min_tokens)


def plain_greedy_drafts(entries: list[ScheduledRequest], logits: torch.Tensor) -> bool:
    """Whether a step is greedy decodes, some verifying drafts, whose every logit row
    is sampled as it is (`samples_raw_rows`), the rows in order: its known token's
    and each draft's."""
    if not entries or logits.dtype != torch.float32:
        return False
    rows = 0
    for entry in entries:
        if not entry.request.params.greedy or not samples_raw_rows(entry):
            return False
        rows += 1 + len(entry.draft_token_ids)
    return rows == logits.shape[0]


NON_FINITE = -1  # `greedy_rows`' entry for a row holding a NaN or an infinity


def greedy_rows(logits: torch.Tensor) -> list[int] | None:
    """Each row's first maximum (its greedy token), or `NON_FINITE` for a row
    holding a NaN or an infinity, from `kvforge_cpp::greedy_rows`
    (kernels/greedy_rows.cpp); None when that cannot run: not CPU float32 rows, or
    kvforge's C++ library not loaded (the sampler never starts a build)."""
    if logits.device.type != "cpu" or not logits.is_contiguous() or not kernel_library.is_loaded():
        return None
    return torch.ops.kvforge_cpp.greedy_rows.default(logits)


def all_finite(logits: torch.Tensor) -> bool:
    """Whether no logit is NaN or infinite (one pass per step; `split_non_finite`
    checks row by row only when not). On CPU numpy's minimum and maximum of float32
    logits (NaN propagates through both) cost less than a torch reduction; else one sum,
    which any NaN or infinity makes non-finite (a finite sum that overflows only
    sends the step to the exact per-row check of `split_non_finite`)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        return math.isfinite(values.min()) and math.isfinite(values.max())
    return math.isfinite(float(logits.sum()))


def split_non_finite(entries: list[ScheduledRequest],
                     logits: torch.Tensor) -> tuple[list[ScheduledRequest], torch.Tensor, list[str]]:
    """The entries whose logit rows are all finite, their rows, and the request
    ids of the others, in plan order."""
    if logits.numel() == 0 or all_finite(logits):
        return entries, logits, []
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return entries, logits, []
    finite = finite.tolist()
    kept, rows, non_finite, row = [], [], [], 0
    for entry in entries:
        span = range(row, row + entry.num_logit_rows)
        row = span.stop
        if all(finite[r] for r in span):
            kept.append(entry)
            rows.extend(span)
        else:
            non_finite.append(entry.request.request_id)
    return kept, logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], non_finite
