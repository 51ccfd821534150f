"""The scheduling mechanism: which requests run this step, and how many tokens
each; and, after the step, what its result does to every request.

Each step brings every scheduled request's computed tokens up toward its known
tokens (prompt + output + draft tokens, when speculating) under a token budget
(`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`). Running requests go first, then
waiting ones, both in the policy's order. A prompt longer than what is left of
the budget is prefilled in chunks, mixed with the decodes of other requests.

When the KV cache runs out of blocks, the policy's victim is preempted: its
blocks are freed, it returns to the waiting queue at its original place, and its
tokens are recomputed when it is admitted again (admission takes prefix-cache
hits, so recomputation is often cheap). A waiting request may also preempt
running ones when the policy's `may_preempt` allows it. The policy is the only
pluggable part; everything else is here.

The scheduler owns each request's position (`num_computed_tokens`) and the KV
cache manager: `update_from_output` is the one place a step's result is applied
(positions advanced, rejected drafts rolled back, full blocks cached, samples
forked, tokens appended, stop checks, finished requests freed).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvforge.core import DraftProposal, SchedulerPolicy

from .request import FinishReason, Request, RequestStatus
from .stopping import check_stop


@dataclass
class ScheduledRequest:
    """`num_tokens` new tokens of `request`, starting at position `start`; the last
    `len(draft_token_ids)` of them are draft tokens to verify (a decode only)."""

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), vocab], None: one-hot
    forks: list[Request] = field(default_factory=list)  # samples > 0 forked from it after this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens + len(self.draft_token_ids)

    @property
    def num_logit_rows(self) -> int:
        """Positions whose logits the step needs: the last token and each draft when sampling."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (cannot fit)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SampledTokens:
    """What sampling (and verification) emitted for one request in one step: the
    accepted drafts then the target's own token, with one logprob record each
    (`{token id: logprob}`, the emitted token included) when the request asks."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None


@dataclass
class StepUpdate:
    """What `update_from_output` did: requests that gained tokens, requests that
    ended, and how many tokens were appended in all."""

    progressed: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    num_generated_tokens: int = 0


class Scheduler:
    """Continuous batching over a `KVCacheManager` (see contracts) and a policy."""

    def __init__(self, policy: SchedulerPolicy, kv, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None):
        self.policy = policy
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len if max_model_len is not None else 2**62  # None: no context limit
        self.waiting: list[Request] = []  # sorted by the policy's waiting key
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._admissions = itertools.count()

    def key(self, request: Request) -> tuple:
        # Cached: a policy's key depends only on what the request was submitted with.
        if request.sort_key is None:
            request.sort_key = self.policy.waiting_key(request.view())
        return request.sort_key

    def add(self, request: Request) -> None:
        """Queue a new or preempted request at its place in the policy's order.
        Its `forks` (samples > 0 of an n > 1 prompt) join when its prompt is computed."""
        bisect.insort(self.waiting, request, key=self.key)

    def add_running(self, request: Request) -> None:
        """Make a request that already holds its blocks (a forked sample) running."""
        request.status = RequestStatus.RUNNING
        request.admitted_index = next(self._admissions)
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, stop_reason=None, error: str | None = None) -> None:
        """End a request wherever it is; its blocks are freed at once."""
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish(reason, stop_reason, error)

    def grow(self, request: Request, num_total_tokens: int) -> bool:
        """`allocate_slots`, skipped when the request's blocks already have room and
        none can be shared: only n > 1 samples share a partly filled block (prefix
        hits are whole blocks, never written again), so only they need copy-on-write."""
        if request.params.n == 1 and num_total_tokens <= self.kv.capacity(request.request_id):
            return True
        return self.kv.allocate_slots(request.request_id, num_total_tokens)

    def schedule(self, drafts: Mapping[str, DraftProposal] | None = None) -> SchedulerOutput:
        """This step's plan. `drafts` (request id to proposal) are scheduled as extra
        query tokens of those requests' decodes, as far as budget and blocks allow:
        drafts are dropped before anyone is preempted for them."""
        drafts = drafts or {}
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self.max_num_batched_tokens

        def preempt(victim: Request) -> None:
            nonlocal budget
            entry = scheduled.pop(victim.request_id, None)
            if entry is not None:
                budget += entry.num_tokens
            self.running.remove(victim)
            self.kv.free(victim.request_id)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.add(victim)
            out.preempted.append(victim)

        def victim_among(candidates: list[Request]) -> Request | None:
            view = self.policy.choose_victim([r.view() for r in candidates])
            return None if view is None else next(r for r in candidates if r.request_id == view.request_id)

        for request in sorted(self.running, key=self.key):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            draft = drafts.get(request.request_id)
            num_drafts = len(draft.token_ids) if draft is not None else 0
            num_new = min(request.num_tokens + num_drafts - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.grow(request, request.num_computed_tokens + num_new):
                if num_drafts:  # speculation is never worth a preemption
                    num_drafts = 0
                    num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                    continue
                if len(self.running) == 1:
                    # Alone and still short of blocks: it can never fit, so stop it here.
                    self.finish(request, FinishReason.LENGTH, error=None)
                    out.finished.append(request)
                    break
                victim = victim_among(self.running)
                preempt(victim)
                if victim is request:
                    break
            else:
                entry = ScheduledRequest(request, request.num_computed_tokens, num_new)
                # The budget may have cut the drafts short: keep those that fit.
                num_drafts = max(0, min(num_drafts, request.num_computed_tokens + num_new - request.num_tokens))
                if num_drafts:
                    entry.draft_token_ids = list(draft.token_ids[:num_drafts])
                    entry.draft_probs = None if draft.probs is None else draft.probs[:num_drafts]
                scheduled[request.request_id] = entry
                budget -= num_new

        # Full blocks this step computes. A waiting request whose next block is among
        # them waits one step and then takes it from the prefix cache, instead of
        # computing the same shared prompt again beside the request computing it now.
        computing = set()
        if self.kv.enable_prefix_caching and self.waiting:  # (pure decode steps skip this)
            for entry in scheduled.values():
                computing.update(self.kv.block_hashes(entry.request.request_id, entry.start,
                                                      entry.start + entry.num_tokens))
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            needs_slot = len(self.running) >= self.max_num_seqs
            if needs_slot:
                view = request.view()
                victim = victim_among([r for r in self.running if self.policy.may_preempt(view, r.view())])
                if victim is None:
                    break
                preempt(victim)
            salt = () if request.cache_salt is None else (("cache_salt", request.cache_salt),)
            computed = self.kv.admit(request.request_id, request.all_token_ids, salt)
            if computing and not needs_slot and self.kv.next_block_hash(request.request_id, computed) in computing:
                self.kv.free(request.request_id)
                break  # strict order: what waits behind it waits too
            num_new = min(request.num_tokens - computed, budget)
            admitted = self.grow(request, computed + num_new)
            while not admitted:
                view = request.view()
                candidates = [r for r in self.running if self.policy.may_preempt(view, r.view())]
                victim = victim_among(candidates)
                if victim is None:
                    break
                preempt(victim)
                admitted = self.grow(request, computed + num_new)
            if not admitted:
                self.kv.free(request.request_id)
                if not self.running:
                    # Even an empty cache cannot hold it: a preempted request that grew too
                    # long ends like a running one would ("length"); a new one is an error.
                    self.waiting.remove(request)
                    if request.output_token_ids:
                        request.finish(FinishReason.LENGTH)
                    else:
                        request.finish(FinishReason.ERROR, error=(
                            f"request {request.group_id!r} needs room for {computed + num_new} tokens, more than "
                            "the whole KV cache holds; raise cache.num_blocks or cache.memory_budget, or shorten it"))
                    out.finished.append(request)
                    continue
                break  # strict order: nothing behind it may jump ahead (no starvation)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed
            request.admitted_index = next(self._admissions)
            self.running.append(request)
            scheduled[request.request_id] = ScheduledRequest(request, computed, num_new)
            budget -= num_new
            if self.kv.enable_prefix_caching:
                computing.update(self.kv.block_hashes(request.request_id, computed, computed + num_new))

        out.scheduled = list(scheduled.values())
        for entry in out.scheduled:
            if entry.request.forks and entry.samples:
                entry.forks = [child for child in entry.request.forks if not child.finished]
                entry.request.forks = []
        return out

    def update_from_output(self, plan: SchedulerOutput, sampled: Mapping[str, SampledTokens]) -> StepUpdate:
        """Apply one step's result. `sampled` maps the id of every request that sampled
        (each sampling entry and each of its forks) to the tokens it emitted.

        Per scheduled request: its computed position advances past the tokens the
        step wrote, less its rejected drafts, whose blocks (those wholly past the
        accepted tokens) go back to the pool; emitted tokens are appended one by one
        with the stop checks, so a stop inside an accepted run cuts the output there;
        blocks that are now full of accepted tokens are offered to the prefix cache;
        samples waiting for this prompt are forked from its blocks; a request that
        stopped ends and frees its blocks."""
        update = StepUpdate()
        now = time.monotonic()
        for entry in plan.scheduled:
            request = entry.request
            emitted = sampled.get(request.request_id)
            computed = entry.start + entry.num_tokens
            if emitted is not None:
                computed -= len(entry.draft_token_ids) - (len(emitted.token_ids) - 1)  # rejected drafts
            stop = self._append(request, emitted, now, update) if emitted is not None else None
            request.num_computed_tokens = min(computed, request.num_tokens)
            if entry.draft_token_ids:
                self.kv.truncate(request.request_id, request.num_computed_tokens)
            self.kv.cache_blocks(request.request_id, request.token_view, request.num_computed_tokens)
            for child in entry.forks:
                self.kv.fork(request.request_id, child.request_id)
                child.num_computed_tokens = request.num_computed_tokens
                child.forked = True
                self.add_running(child)
                child_stop = self._append(child, sampled[child.request_id], now, update)
                if child_stop is not None:
                    self.finish(child, *child_stop)
                    update.finished.append(child)
            if stop is not None:
                self.finish(request, *stop)
                update.finished.append(request)
        return update

    def _append(self, request: Request, emitted: SampledTokens, now: float,
                update: StepUpdate) -> tuple[FinishReason, int | str | None] | None:
        """Append emitted tokens until one ends the request; `(reason, stop_reason)` then."""
        request.first_token_time = request.first_token_time or now
        update.progressed.append(request)
        for i, token in enumerate(emitted.token_ids):
            request.output_token_ids.append(token)
            if emitted.logprobs is not None and request.logprobs is not None:
                record = emitted.logprobs[i]
                request.logprobs.append(record)
                request.cumulative_logprob += record[token]
            update.num_generated_tokens += 1
            reason, stop_reason = check_stop(request, self.max_model_len)
            if reason is not None:
                return reason, stop_reason
        return None
