"""The scheduling mechanism: which requests run this step, and how many tokens each.

Each step brings every scheduled request's computed tokens up toward its known
tokens (prompt + output) under a token budget (`max_num_batched_tokens`) and a
cap on running requests (`max_num_seqs`). Running requests go first, then
waiting ones, both in the policy's order. A prompt longer than what is left of
the budget is prefilled in chunks, mixed with the decodes of other requests.

When the KV cache runs out of blocks, the policy's victim is preempted: its
blocks are freed, it returns to the waiting queue at its original place, and its
tokens are recomputed when it is admitted again (admission takes prefix-cache
hits, so recomputation is often cheap). A waiting request may also preempt
running ones when the policy's `may_preempt` allows it. The policy is the only
pluggable part; everything else is here.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from kvforge.core import SchedulerPolicy

from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    """`num_tokens` new tokens of `request`, starting at position `start`."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (cannot fit)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching over a `KVCacheManager` (see contracts) and a policy."""

    def __init__(self, policy: SchedulerPolicy, kv, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.policy = policy
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
        """Queue a new or preempted request at its place in the policy's order."""
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
        if num_total_tokens <= request.num_slots and request.params.n == 1:
            return True
        if not self.kv.allocate_slots(request.request_id, num_total_tokens):
            return False
        size = self.kv.block_size
        request.num_slots = -(-num_total_tokens // size) * size
        return True

    def schedule(self) -> SchedulerOutput:
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
            victim.num_slots = 0
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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.grow(request, request.num_computed_tokens + num_new):
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
                scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
                budget -= num_new

        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                view = request.view()
                victim = victim_among([r for r in self.running if self.policy.may_preempt(view, r.view())])
                if victim is None:
                    break
                preempt(victim)
            computed = self.kv.admit(request.request_id, request.all_token_ids)
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
                request.num_slots = 0
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

        out.scheduled = list(scheduled.values())
        return out
