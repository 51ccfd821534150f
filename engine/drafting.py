"""Ask the speculative proposer for draft tokens before each step, and check them.

Only running requests in decode (every known token computed but the last, with
output already) are asked, and none while more requests than
`speculative.disable_above_batch_size` run (decode is compute-bound there, so
verifying drafts costs more than it saves). Each request's draft is cut so that
accepting all of it could never pass its `max_tokens` or the model's context,
and, under `speculative.draft_policy = "adaptive"`, to the drafts that pay
(`draft_policy`).

A proposal that breaks the proposer contract (wrong count, too many tokens, ids
outside the vocabulary, malformed probabilities) raises `ProposerError` naming
the proposer, before anything is scheduled: no request's state has changed, and
a broken plugin is reported rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvforge.core import ConfigError, DraftProposal, KvforgeError, ProposalRequest, SpeculativeProposer

from .draft_costs import step_clock
from .draft_policy import DRAFT_POLICIES, AdaptiveDraftPolicy, seeded_sampling
from .request import Request
from .scheduler_output import ScheduledRequest


TIMED_EVERY = 4  # steps of a quiet or steady batch timed: one in this many
# Under adaptive drafting, after steps on which the proposer had nothing for any running
# request (ngram on text with no repeat), the next step may run that many decode passes
# as one burst: 1, 2, 4, then this many (a proposal anyone gets starts it again at 1).
EMPTY_BURST_MAX = 8


class ProposerError(KvforgeError, RuntimeError):
    """A speculative proposer returned something the contract forbids."""


class Drafter:
    """Wraps one proposer with the engine's limits (`num_tokens`, batch size,
    per-request `max_tokens` and context) and checks what it returns."""

    def __init__(self, proposer: SpeculativeProposer, *, num_tokens: int, disable_above_batch_size: int | None,
                 vocab_size: int, max_model_len: int, draft_policy: str = "fixed", device="cpu"):
        if draft_policy not in DRAFT_POLICIES:
            raise ConfigError(f"speculative.draft_policy {draft_policy!r} is not one of {list(DRAFT_POLICIES)}; "
                              "adaptive drafts per request what pays, fixed always drafts num_tokens")
        self.proposer = proposer
        self.name = proposer.name
        self.num_tokens = num_tokens
        self.disable_above_batch_size = disable_above_batch_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.clock = step_clock(device)
        self.policy = (AdaptiveDraftPolicy(cheap_proposer=proposer.cheap, clock=self.clock)
                       if draft_policy == "adaptive" else None)
        self._step_started: float | None = None  # when the step being run started, if it is timed
        # (requests, drafts, passes) of the last step if it was pure decodes: it is timed up
        # to the next `propose`, so what the engine and its caller do per step after it counts too
        self._timing: tuple[int, int, int] | None = None
        # The decode passes the step being scheduled may run as one burst (multi-step
        # decoding): any number where speculation is off for the batch, up to the next
        # ask in a quiet batch (`AdaptiveDraftPolicy.quiet_passes`), more after each step
        # the proposer had nothing for anyone (EMPTY_BURST_MAX), else 1.
        self.burst_passes: int | None = 1
        self._empty_steps = 0

    def limit(self, request: Request) -> int:
        """The most draft tokens `request` may take now: all accepted plus the
        target's own token must stay within `max_tokens` and the context."""
        output_left = request.params.max_tokens - len(request.output_token_ids) - 1
        # Drafts sit at positions num_tokens .. num_tokens + d - 1, which must exist.
        context_left = self.max_model_len - request.num_tokens
        return min(self.num_tokens, output_left, context_left)

    def propose(self, running: Sequence[Request]) -> dict[str, DraftProposal]:
        """Drafts for the running requests that speculate this step, by request id.
        Called first thing in a step: a step is timed from here (once its requests are
        known) to the next call. Sets `burst_passes`."""
        drafts = self._propose(running)
        if self.burst_passes != 1 and any(r.params.speculative and seeded_sampling(r) for r in running):
            # A seeded sample's draws depend on which of its tokens are verified drafts;
            # where bursts end depends on time, so with one running every step is scheduled.
            self.burst_passes = 1
        return drafts

    def _propose(self, running: Sequence[Request]) -> dict[str, DraftProposal]:
        policy, now = self.policy, None
        if self._timing is not None:
            now = self.clock()
            num_requests, num_drafts, passes = self._timing
            policy.timed(num_requests, num_drafts, (now - self._step_started) / passes)
            self._timing = None
        self._step_started = None
        self.burst_passes = 1
        if self.disable_above_batch_size is not None and len(running) > self.disable_above_batch_size:
            self.burst_passes = None
            return {}
        if policy is not None and policy.quiet(len(running)):
            # A quiet batch's plain steps only keep the plain median current: one in
            # TIMED_EVERY is timed.
            if not policy.step % TIMED_EVERY:
                self._step_started = self.clock() if now is None else now
            self.burst_passes = policy.quiet_passes()
            return {}
        asked, limits = [], []
        for request in running:
            if (request.params.speculative and request.output_token_ids
                    and request.num_computed_tokens == request.num_tokens - 1):
                limit = self.limit(request)
                if limit > 0:
                    asked.append(request)
                    limits.append(limit)
        steady = policy is not None and asked and len(asked) == len(running) and policy.steady(asked)
        if policy is not None and (not steady or not policy.step % TIMED_EVERY):  # a steady batch's: as a quiet one's
            self._step_started = self.clock() if now is None else now
        if not asked:
            return {}
        counts = limits
        if policy is not None and not steady:
            counts, asks = policy.choose(asked, limits, everyone=len(asked) == len(running))
            kept = [i for i, ask in enumerate(asks) if ask]
            if not kept:
                self._burst_if_quiet(len(running))
                return {}
            asked, limits, counts = [asked[i] for i in kept], [limits[i] for i in kept], [counts[i] for i in kept]
        # a cheap proposer drafts to the limit, so drafts not verified are scored too
        num_tokens = max(limits if self.proposer.cheap else counts)
        # What a step that asks for shadow drafts spends on drafting, from the step's start
        # (the choice and the checks too, not only the proposer), is what asking costs.
        timed = policy is not None and policy.shadowed
        proposals = self.proposer.propose(
            [ProposalRequest(r.request_id, r.all_token_ids, r.params.temperature) for r in asked], num_tokens)
        self.check(proposals, asked, num_tokens)
        if policy is not None and len(asked) == len(running) and not any(p.token_ids for p in proposals):
            self.burst_passes = min(2 ** self._empty_steps, EMPTY_BURST_MAX)
            self._empty_steps += 1
        else:
            self._empty_steps = 0
        drafts = {}
        for request, proposal, count, limit in zip(asked, proposals, counts, limits):
            if policy is not None and not steady:  # a steady step's outcomes are read off the step
                policy.proposed(request, proposal.token_ids[:limit], count)
            if proposal.token_ids and count:
                token_ids = list(proposal.token_ids[:count])
                probs = None if proposal.probs is None else proposal.probs[:count]
                drafts[request.request_id] = DraftProposal(token_ids, probs)
        if timed:
            policy.asked(len(asked), self.clock() - self._step_started)
        if not drafts:  # (shadow drafts, scored against the tokens the burst brings)
            self._burst_if_quiet(len(running))
        return drafts

    def _burst_if_quiet(self, num_running: int) -> None:
        """After a choice that left the batch quiet (`AdaptiveDraftPolicy.quiet`):
        its step may burst up to the next ask."""
        if self.policy is not None and self.policy.quiet(num_running):
            self.burst_passes = max(self.burst_passes, self.policy.quiet_passes())

    def observe(self, scheduled: Sequence[ScheduledRequest], passes: int = 1) -> None:
        """After a step has applied its result (`scheduled`, run as `passes` decode
        passes): lets the adaptive policy score proposals against the new tokens, and
        marks a step of pure decodes to be timed (up to the next `propose`; a burst
        per pass, so that drafts are weighed against what a plain pass costs then)."""
        if self.policy is None or not scheduled:
            return
        if self._step_started is not None and all(e.num_tokens == 1 + len(e.draft_token_ids) for e in scheduled):
            self._timing = (len(scheduled), sum(len(e.draft_token_ids) for e in scheduled), passes)  # pure decodes
        self.policy.observe(scheduled, passes)

    def check(self, proposals, asked: Sequence[Request], num_tokens: int) -> None:
        """Raise `ProposerError` unless `proposals` keep the proposer contract."""
        def fail(why: str) -> None:
            raise ProposerError(f"speculative proposer {self.name!r} {why}; this is a bug in the proposer "
                                "(fix it, or unset speculative.proposer to run without speculation)")

        if not isinstance(proposals, list) or len(proposals) != len(asked):
            count = len(proposals) if isinstance(proposals, list) else type(proposals).__name__
            fail(f"returned {count} proposals for {len(asked)} requests; it must return one per request, in order")
        for request, proposal in zip(asked, proposals):
            if not isinstance(proposal, DraftProposal):
                fail(f"returned a {type(proposal).__name__} for request {request.request_id!r}, not a DraftProposal")
            tokens = proposal.token_ids
            if len(tokens) > num_tokens:
                fail(f"proposed {len(tokens)} tokens for request {request.request_id!r}, more than the "
                     f"{num_tokens} asked")
            if tokens and not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens):
                bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
                fail(f"proposed token ids {bad[:5]} for request {request.request_id!r}, which are not Python ints "
                     f"inside the target's vocabulary [0, {self.vocab_size})")
            if proposal.probs is not None:
                self._check_probs(proposal, request, fail)

    def _check_probs(self, proposal: DraftProposal, request: Request, fail) -> None:
        probs, tokens = proposal.probs, proposal.token_ids
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (len(tokens), self.vocab_size):
            shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            fail(f"returned probs of shape {shape} for request {request.request_id!r}; they must be "
                 f"[{len(tokens)}, {self.vocab_size}] (one row per draft token) or None")
        if tokens:
            # Accepting with probability p/q needs q > 0 at the draft: a zero would bias the output.
            mass = probs.gather(1, torch.tensor(tokens, device=probs.device).unsqueeze(1))
            if not bool((mass > 0).all()):
                fail(f"gave a draft token of request {request.request_id!r} zero probability in its own probs")

    def release(self, requests: Iterable[Request]) -> None:
        """Let the proposer (and the adaptive policy) forget finished requests."""
        for request in requests:
            self.proposer.release(request.request_id)
            if self.policy is not None:
                self.policy.release(request.request_id)
