"""The scheduling mechanism: which requests run this step, and how many tokens
each; and, after the step, what its result does to every request.

Each step brings every scheduled request's computed tokens up toward its known
tokens (prompt + output + draft tokens, when speculating) under a token budget
(`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`), in
two phases: the running requests first, then the admission of waiting ones,
both in the policy's order. A prompt longer than what is left of the budget is
prefilled in chunks, mixed with the decodes of other requests.

When the KV cache runs out of blocks, the policy's victim is preempted: its
blocks are freed, it returns to the waiting queue at its original place, and its
tokens are recomputed when it is admitted again (admission takes prefix-cache
hits, so recomputation is often cheap). A waiting request may also preempt
running ones when the policy's `may_preempt` allows it. The policy is the only
pluggable part; everything else is here.

The scheduler owns each request's position (`num_computed_tokens`) and the KV
cache manager: `update_from_output` is the one place a step's result is applied
(requests with non-finite logits ended, positions advanced, rejected drafts
rolled back, full blocks cached, samples forked, tokens appended, stop checks,
finished requests freed). Whatever ends a request also ends the samples still
waiting to fork from it. The data passed between the step's parts is in
`scheduler_output.py`.

A request with structured outputs also owns a grammar beside its position: it
waits in `waiting_for_grammar` (out of the policy's order, so it holds back no
one) until its grammars compile, and every token appended to its output is
accepted by its grammar. Preemption keeps the grammar as it is: the output
tokens it accepted stay, and recomputing them accepts nothing again.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvforge.core import DraftProposal, SchedulerPolicy

from .request import FinishReason, Request, RequestStatus
from .scheduler_output import SampledTokens, SamplerOutput, ScheduledRequest, SchedulerOutput, StepUpdate
from .stopping import check_stop

NON_FINITE_LOGITS = (
    "the model produced non-finite logits (NaN or infinity) for output token {index} of this request, so no token "
    "can be sampled; the checkpoint may hold non-finite weights (loading warns, naming the tensor) or the dtype "
    "overflows (try dtype = 'float32')")


@dataclass
class _PlanInProgress:
    """The step `schedule` is planning: its entries by request id, the token
    budget they leave, and the requests preempted or ended on the way."""

    budget: int
    entries: dict[str, ScheduledRequest] = field(default_factory=dict)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)

    def add(self, entry: ScheduledRequest) -> None:
        self.entries[entry.request.request_id] = entry
        self.budget -= entry.num_tokens

    def drop(self, request: Request) -> None:
        """Take a preempted request out of the plan, its tokens back into the budget."""
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self.budget += entry.num_tokens


class Scheduler:
    """Continuous batching over a `KVCacheManager` (see contracts) and a policy."""

    def __init__(self, policy: SchedulerPolicy, kv, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, structured_outputs=None, max_loras: int | None = None):
        self.policy = policy
        self.structured_outputs = structured_outputs  # a StructuredOutputs when requests may carry grammars
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len if max_model_len is not None else 2**62  # None: no context limit
        self.max_loras = max_loras  # most distinct LoRA adapters among the running requests; None: no adapters
        self.waiting: list[Request] = []  # sorted by the policy's waiting key
        self.running: list[Request] = []  # in admission order
        self.waiting_for_grammar: list[Request] = []  # new structured requests whose grammars compile
        self.num_preemptions = 0
        self._admissions = itertools.count()

    def key(self, request: Request) -> tuple:
        # Cached: a policy's key depends only on what the request was submitted with.
        if request.sort_key is None:
            request.sort_key = self.policy.waiting_key(request.view())
        return request.sort_key

    def add(self, request: Request) -> None:
        """Queue a new or preempted request at its place in the policy's order.
        Its `forks` (samples > 0 of an n > 1 prompt) join when its prompt is computed.
        A request whose grammars are compiling (`grammar_job`) waits for them first."""
        if request.grammar_job is not None:
            self.waiting_for_grammar.append(request)
            return
        bisect.insort(self.waiting, request, key=self.key)

    def add_running(self, request: Request) -> None:
        """Make a request that already holds its blocks (a forked sample) running."""
        request.status = RequestStatus.RUNNING
        request.admitted_index = next(self._admissions)
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def others_wait(self, plan: SchedulerOutput) -> bool:
        """Whether a request outside `plan` waits to run: queued, compiling its
        grammar, or running but left out of this step."""
        return bool(self.waiting or self.waiting_for_grammar) or len(plan.scheduled) < len(self.running)

    def finish(self, request: Request, reason: FinishReason, stop_reason=None, error: str | None = None) -> None:
        """End a request wherever it is; its blocks are freed at once. The samples
        still waiting to fork from it (n > 1, its prompt never computed) end with it."""
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.waiting_for_grammar:
            self.waiting_for_grammar.remove(request)
        request.grammar = request.grammar_job = None
        request.finish(reason, stop_reason, error)
        if request.forks:
            _end_unforked(request.forks, request)
            request.forks = []

    def grow(self, request: Request, num_total_tokens: int) -> bool:
        """`allocate_slots`, skipped when the request's blocks already have room and
        none can be shared: only n > 1 samples share a partly filled block (prefix
        hits are whole blocks, never written again), so only they need copy-on-write."""
        if request.params.n == 1 and num_total_tokens <= self.kv.capacity(request.request_id):
            return True
        return self.kv.allocate_slots(request.request_id, num_total_tokens)

    def reserve_steps(self, plan: SchedulerOutput, steps: int) -> int:
        """Room in the KV cache for `steps` decode steps of every entry of `plan`
        (a multi-step burst, `decode_bursts`): `steps` when every request's blocks
        could grow to hold them, else 1. Nobody is preempted for a burst; blocks
        grown before one fell short stay with their requests for the next steps."""
        for entry in plan.scheduled:
            if not self.grow(entry.request, entry.start + steps):
                return 1
        return steps

    def schedule(self, drafts: Mapping[str, DraftProposal] | None = None) -> SchedulerOutput:
        """This step's plan: the running requests first (`_schedule_running`), then
        waiting ones admitted with what is left (`_schedule_waiting`). `drafts`
        (request id to proposal) are scheduled as extra query tokens of those
        requests' decodes, as far as budget and blocks allow: drafts are dropped
        before anyone is preempted for them."""
        plan = _PlanInProgress(self.max_num_batched_tokens)
        if self.waiting_for_grammar:
            self._queue_compiled(plan)
        self._schedule_running(plan, drafts or {})
        self._schedule_waiting(plan)
        out = plan.out
        out.scheduled = list(plan.entries.values())
        for entry in out.scheduled:
            if entry.request.forks and entry.samples:
                entry.forks = [child for child in entry.request.forks if not child.finished]
                entry.request.forks = []
        return out

    def _queue_compiled(self, plan: _PlanInProgress) -> None:
        """Requests whose grammars are ready join the waiting queue, each sample with
        its own grammar; one whose compile failed or timed out ends ("error")."""
        for request in list(self.waiting_for_grammar):
            job = request.grammar_job
            outcome = self.structured_outputs.poll(job)
            if outcome is None:
                continue
            self.waiting_for_grammar.remove(request)
            request.grammar_job = None
            if isinstance(outcome, str):
                self.finish(request, FinishReason.ERROR, error=outcome)
                plan.out.finished.append(request)
                continue
            for sample, grammar in zip([request, *request.forks], outcome):
                sample.grammar, sample.grammar_backend = grammar, job.backend
            self.add(request)

    # The running phase

    def _schedule_running(self, plan: _PlanInProgress, drafts: Mapping[str, DraftProposal]) -> None:
        """Every running request, in the policy's order, gets its next tokens while
        the budget lasts; one short of blocks preempts the policy's victims."""
        for request in sorted(self.running, key=self.key):
            if plan.budget == 0:
                break
            if request.status is RequestStatus.RUNNING:  # else preempted earlier in this loop
                self._schedule_running_request(request, drafts.get(request.request_id), plan)

    def _schedule_running_request(self, request: Request, draft: DraftProposal | None, plan: _PlanInProgress) -> None:
        """Its next tokens and drafts. Short of blocks, it drops its drafts first, then
        preempts the policy's victim (itself, maybe); alone, it ends ("length")."""
        num_drafts = len(draft.token_ids) if draft is not None else 0
        num_new = min(request.num_tokens + num_drafts - request.num_computed_tokens, plan.budget)
        if num_new <= 0:
            return
        while not self.grow(request, request.num_computed_tokens + num_new):
            if num_drafts:  # speculation is never worth a preemption
                num_drafts = 0
                num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
                continue
            if len(self.running) == 1:
                # Alone and still short of blocks: it can never fit, so stop it here.
                self.finish(request, FinishReason.LENGTH)
                plan.out.finished.append(request)
                return
            victim = self._victim_among(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return
        entry = ScheduledRequest(request, request.num_computed_tokens, num_new)
        # The budget may have cut the drafts short: keep those that fit.
        num_drafts = max(0, min(num_drafts, request.num_computed_tokens + num_new - request.num_tokens))
        if num_drafts:
            entry.draft_token_ids = list(draft.token_ids[:num_drafts])
            entry.draft_probs = None if draft.probs is None else draft.probs[:num_drafts]
        plan.add(entry)

    # The admission phase

    def _schedule_waiting(self, plan: _PlanInProgress) -> None:
        """Waiting requests start in the policy's order, strictly: the first that
        cannot start now holds back every one behind it (no starvation). Admission
        stops once this step has preempted anyone. The one exception: a request of
        a LoRA adapter beyond `max_loras` waits without holding back the others."""
        computing = self._blocks_computed_by(plan)
        held_back: list[Request] = []  # of a LoRA adapter that cannot join this step
        while self.waiting and plan.budget > 0 and not plan.out.preempted:
            if self._adapter_must_wait(self.waiting[0]):
                held_back.append(self.waiting.pop(0))
                continue
            if not self._admit_first_waiting(plan, computing):
                break
        for request in held_back:  # back at their places, still first in line for their adapter
            bisect.insort(self.waiting, request, key=self.key)

    def _adapter_must_wait(self, request: Request) -> bool:
        """Whether `request` runs a LoRA adapter beyond the `max_loras` distinct ones
        the running requests use: it waits (keeping its place) while requests of
        the adapters already running, or of the base model, go past it, as in vLLM."""
        if self.max_loras is None or request.lora_request is None:
            return False
        running = {r.lora_id for r in self.running if r.lora_request is not None}
        return request.lora_id not in running and len(running) >= self.max_loras

    def _blocks_computed_by(self, plan: _PlanInProgress) -> set:
        """Full blocks the plan computes. A waiting request whose next block is among
        them waits one step and then takes it from the prefix cache, instead of
        computing the same shared prompt again beside the request computing it now."""
        computing = set()
        if self.kv.enable_prefix_caching and self.waiting:  # (pure decode steps skip this)
            for entry in plan.entries.values():
                computing.update(self.kv.block_hashes(entry.request.request_id, entry.start,
                                                      entry.start + entry.num_tokens))
        return computing

    def _admit_first_waiting(self, plan: _PlanInProgress, computing: set) -> bool:
        """Start the first waiting request with its prefix-cache hits, preempting
        what the policy's `may_preempt` allows for a slot or for blocks. False
        when it must wait, and everything behind it with it."""
        request = self.waiting[0]
        needs_slot = len(self.running) >= self.max_num_seqs
        if needs_slot:
            victim = self._victim_among(self._preemptible_by(request))
            if victim is None:
                return False
            self._preempt(victim, plan)
        # prompt logprobs need every prompt position's logits, which cached blocks do not have
        computed = self.kv.admit(request.request_id, () if request.needs_prompt_logits else request.all_token_ids,
                                 request.prefix_extra_keys())
        if computing and not needs_slot and self.kv.next_block_hash(request.request_id, computed) in computing:
            self.kv.free(request.request_id)
            return False
        num_new = min(request.num_tokens - computed, plan.budget)
        admitted = self.grow(request, computed + num_new)
        while not admitted:
            victim = self._victim_among(self._preemptible_by(request))
            if victim is None:
                break
            self._preempt(victim, plan)
            admitted = self.grow(request, computed + num_new)
        if not admitted:
            self.kv.free(request.request_id)
            if self.running:
                return False
            # Even an empty cache cannot hold it: a preempted request that grew too
            # long ends like a running one would ("length"); a new one is an error.
            if request.output_token_ids:
                self.finish(request, FinishReason.LENGTH)
            else:
                self.finish(request, FinishReason.ERROR, error=(
                    f"request {request.group_id!r} needs room for {computed + num_new} tokens, more than "
                    "the whole KV cache holds; raise cache.num_blocks or cache.memory_budget, or shorten it"))
            plan.out.finished.append(request)
            return True
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = computed
        request.admitted_index = next(self._admissions)
        self.running.append(request)
        plan.add(ScheduledRequest(request, computed, num_new))
        if self.kv.enable_prefix_caching:
            computing.update(self.kv.block_hashes(request.request_id, computed, computed + num_new))
        return True

    # Preemption

    def _preemptible_by(self, request: Request) -> list[Request]:
        view = request.view()
        return [r for r in self.running if self.policy.may_preempt(view, r.view())]

    def _victim_among(self, candidates: list[Request]) -> Request | None:
        view = self.policy.choose_victim([r.view() for r in candidates])
        return None if view is None else next(r for r in candidates if r.request_id == view.request_id)

    def _preempt(self, victim: Request, plan: _PlanInProgress) -> None:
        """Free the victim's blocks and queue it again at its place; it is recomputed when admitted."""
        plan.drop(victim)
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add(victim)
        plan.out.preempted.append(victim)

    # The step's result

    def update_from_output(self, plan: SchedulerOutput, output: SamplerOutput) -> StepUpdate:
        """Apply one step's result: `output.tokens` maps the id of every request that
        sampled (each sampling entry and each of its forks) to the tokens it emitted.

        First, each request in `output.non_finite` ends with finish reason "error"
        and frees its blocks (its samples waiting to fork end with it); the step
        changes nothing else of it. Then per scheduled request: its computed
        position advances past the tokens the step wrote, less its rejected drafts,
        whose blocks (those wholly past the accepted tokens) go back to the pool;
        emitted tokens are appended one by one with the stop checks, so a stop
        inside an accepted run cuts the output there; blocks that are now full of
        accepted tokens are offered to the prefix cache; samples waiting for this
        prompt are forked from its blocks; a request that stopped ends and frees
        its blocks."""
        update = StepUpdate()
        entries = plan.scheduled
        if output.non_finite:
            entries = self._end_non_finite(entries, set(output.non_finite), update)
        sampled = output.tokens
        now = time.monotonic()
        for entry in entries:
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

    def _end_non_finite(self, entries: list[ScheduledRequest], ids: set[str],
                        update: StepUpdate) -> list[ScheduledRequest]:
        """End the entries whose request is in `ids` (sampling them would emit garbage
        tokens); returns the others."""
        kept = []
        for entry in entries:
            request = entry.request
            if request.request_id not in ids:
                kept.append(entry)
                continue
            self.finish(request, FinishReason.ERROR,
                        error=NON_FINITE_LOGITS.format(index=len(request.output_token_ids)))
            _end_unforked(entry.forks, request)  # taken from request.forks when it was scheduled
            update.failed.append(request)
            update.finished.append(request)
        return kept

    def _append(self, request: Request, emitted: SampledTokens, now: float,
                update: StepUpdate) -> tuple | None:
        """Append emitted tokens until one ends the request; `(reason, stop_reason)` then
        (`(reason, None, error)` when its grammar refuses a token)."""
        request.first_token_time = request.first_token_time or now
        update.progressed.append(request)
        for i, token in enumerate(emitted.token_ids):
            request.output_token_ids.append(token)
            if emitted.logprobs is not None and request.logprobs is not None:
                record = emitted.logprobs[i]
                request.logprobs.append(record)
                request.cumulative_logprob += record[token]
            update.num_generated_tokens += 1
            if request.grammar is not None and not request.grammar.accept_tokens([token]):
                return FinishReason.ERROR, None, (
                    f"structured output backend {request.grammar_backend.name!r} refused token {token} that its own "
                    "mask allowed; this is a bug in the backend (run `kvforge conformance` on it)")
            reason, stop_reason = check_stop(request, self.max_model_len)
            if reason is not None:
                return reason, stop_reason
        return None


def _end_unforked(samples: list[Request], parent: Request) -> None:
    """End the samples that never forked from `parent` as `parent` ended."""
    for sample in samples:
        if not sample.finished:
            sample.finish(parent.finish_reason, error=parent.error)
