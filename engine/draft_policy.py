"""How many drafts each request verifies this step: `fixed` (as many as allowed) or
`adaptive` (as many as pay, per request, from measured acceptance and step costs).

Adaptive drafting, each step:

1. every request that may draft has its expected gain per draft position from
   its own recent proposals (`draft_acceptance`);
2. the engine's measured step costs at this batch size (`draft_costs.StepCostModel`:
   the median plain step and what drafts cost relative to it) say what the step
   costs with D drafts (after `PLAIN_REFRESH` steps with drafts in a row, one step
   drafts nothing, to renew the median; after `COST_PROBE_EVERY` without, one
   drafts all it may, to measure drafts anew);
3. if even the largest gain could not pay for a draft (`may_pay`), nobody drafts
   (the common case on unpredictable text, decided without the full choice);
   otherwise `best_draft_counts` picks the drafts that maximise expected tokens
   per second, which may be none for some requests, or for all (drafts are taken
   only where they raise it by `draft_costs.MIN_GAIN`). A choice is made again
   at most every `RECHOOSE_EVERY` steps while the requests, their limits and the
   cost estimate stay the same and no request that drafted nothing would have
   had a draft accepted; one that gives every request all it may stands for
   `STEADY_FOR` steps without being looked at (`steady`): choosing every step,
   then every fourth, cost a batch-1 step more than it changed. Such a window's
   proposals are not handed to the policy: each step's outcomes are read off the
   step and counted together when the window ends, in the order they came (on
   their step while older proposals wait to be scored).

While the cost model lacks steps at this batch size (a new engine, or a batch
size not seen yet), requests draft as many as allowed, except that one step in
`WARM_UP_CYCLE` drafts nothing until plain steps are known and another drafts
half as many, so the model sees how the cost grows with the drafts. Once some
other batch size is measured, such a step is paid from the probe allowance below
(at what drafts cost at the nearest measured batch size), so the batch sizes a
draining batch passes through for a few steps cost little.

Steps that verify drafts which do not pay, to learn (a costly proposer's probes,
the cost model's step that measures drafts anew, warm-up at a new batch size
once another is known), spend an *allowance* counted in plain steps: it grows by
`PROBE_BUDGET` a step up to `ALLOWANCE_MAX`, a probe goes only when it covers
what the cost model says the probe adds to the step (one dearer than
`ALLOWANCE_MAX` goes when it is full, the debt paid back by the next steps), and
probes it does not cover wait. A cheap proposer's shadow drafts (below) are paid
from it too, at what asking and scoring them is measured to cost per request
(`ask_seconds`). Learning so costs at most about `PROBE_BUDGET` of the decode
time, whatever the batch and the proposer.

A request that drafts nothing must be able to start again when its text becomes
predictable, so it keeps being *probed*, at waits that double while drafting
does not pay (start short again when it does, and halve when one of its
unverified drafts would have been accepted):

* a cheap proposer (`SpeculativeProposer.cheap`, e.g. `ngram`) is asked for it
  every 1, 2, 4, then `SHADOW_AFTER_MAX` steps, and its would-be drafts are scored
  against the tokens that follow (shadow drafts): no verification cost;
* a proposer that runs a model is not asked for it, except that after 16, 32, ...
  up to `PROBE_AFTER_MAX` steps it verifies a full draft once (as far as the
  allowance below covers it), whose outcome replaces the request's old estimate;
  an accepted draft in it does not shorten the wait, since the new estimate is
  what decides whether the request drafts.

The waits are kept on the engine's step count (a wait of w falls on multiples of
w, of `SHADOW_AFTER_MAX` past it), so requests that draft nothing are asked on
the same few steps and the steps between cost nothing for them. A request's
first step asks a cheap proposer at once, so it has evidence of its own from the
start; a costly one drafts from the engine-wide estimate until its first probe.

A seeded sampled request (`SamplingParams.seed`) drafts as under `fixed`: its
random draws depend on how many drafts it verifies, and counts chosen from
measured times would make its output differ from run to run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.core import cdiv

from .draft_acceptance import AcceptanceTracker, RequestAcceptance
from .draft_costs import StepCostModel, StepCosts, best_draft_counts, may_pay
from .request import Request
from .scheduler_output import ScheduledRequest

DRAFT_POLICIES = ("adaptive", "fixed")
WARM_UP_CYCLE = 4  # while costs are unknown: a plain step (until known), full, half, full
SHADOW_AFTER_MAX = 8
RECHOOSE_EVERY = 4  # steps a choice may be reused while nothing but the acceptance estimates changed
STEADY_FOR = 8  # steps a choice giving every request all its drafts stands (`steady`)
PROBE_AFTER = 16
PROBE_AFTER_MAX = 128
ASK_COST_WEIGHT = 0.1  # of the newest measurement in the moving averages of what asking and scoring cost
# Plain steps' worth of probing earned per step: probes cost at most 0.5% of the time, so
# that with the policy's own bookkeeping on every step, speculation that does not pay
# stays well inside 5% of no speculation on a small model (docs/benchmarks.md).
PROBE_BUDGET = 0.005
ALLOWANCE_MAX = 4.0  # the most it saves up (plain steps)


def seeded_sampling(request: Request) -> bool:
    """A sampled request with its own seed: it drafts as under `fixed` (module docstring)."""
    return request.generator is not None and not request.params.greedy


def _extra_steps(costs: StepCosts, drafting: int, more: int) -> float:
    """What `more` drafts add to a step that already verifies `drafting`, in plain steps."""
    return (costs.seconds(drafting + more) - costs.seconds(drafting)) / costs.base


def _outcome(entry: ScheduledRequest) -> tuple[str, int, int]:
    """(request id, drafts accepted, drafts decided) of a proposal the step (`entry`)
    verified whole, read off how many tokens the request gained: all but the target's
    own were accepted drafts. A rejected draft was decided too; where every draft the
    scheduler verified was accepted, the next (if proposed, and cut) was not."""
    accepted = entry.request.num_tokens - entry.start - 2
    return entry.request.request_id, accepted, accepted + (accepted < len(entry.draft_token_ids))


@dataclass
class _Pause:
    """When a request that drafts nothing is next asked for drafts."""

    last_asked: int
    wait: int
    hits: int = 0  # its acceptance's `hits` when last seen: a new hit shortens the wait
    first: bool = False  # asked on its first step (a cheap proposer): that ask leaves the wait as it is
    drafting: bool = False  # it verified drafts when last asked


class AdaptiveDraftPolicy:
    """Per-request draft counts from acceptance and measured cost (module docstring)."""

    def __init__(self, *, cheap_proposer: bool, clock=time.process_time):
        self.cheap_proposer = cheap_proposer
        self.clock = clock  # the Drafter's step clock: what asking and scoring cost is measured with
        # Seconds one request's proposal costs the engine: the drafting work of a step that
        # asks for it (the choice, the proposer, the checks; measured by the Drafter, `asked`)
        # and scoring it (`observe`); moving averages,
        # of the steps that asked for shadow drafts (`shadowed` of them) and the next.
        self.propose_seconds = self.score_seconds = 0.0
        self.shadowed = 0
        self._time_scoring = False
        self.acceptance = AcceptanceTracker()
        self.costs = StepCostModel()
        self.pauses: dict[str, _Pause] = {}
        self.step = 0  # decode passes: a burst counts each of its passes
        self._passes = 1  # of the step being observed
        self.probing: set[str] = set()  # request ids whose proposal this step restarts their estimate
        # Proposals this step verifies whole, counted from its outcome: (request, its token
        # count when proposed, whether the outcome restarts its estimate).
        self._verifying: list[tuple[Request, int, bool]] = []
        # Outcomes of a steady window's steps (`_outcome`): nothing reads the estimates until
        # the window ends, so they are counted then, in the order they came (`_count_held`).
        self._held: list[tuple[str, int, int]] = []
        self._last_key: tuple | None = None
        self._hits = 0  # unverified drafts that would have been accepted, so far: each makes `_best_counts` choose again
        # A batch where every request drafts all it may: the choice stands until `_steady_until` (`steady`).
        self._steady_requests: Sequence[Request] = []
        self._steady_until = 0
        self._last_counts: list[int] = []
        # A quiet batch: every running request decodes, none drafts, none is due to be asked
        # before `_next_ask`; until then (or until something changes) `quiet` skips the step.
        self._quiet_size: int | None = None
        self._quiet_limit = self._quiet_positions = 0  # its largest limit and all its limits
        self._next_ask = 0
        # Probes that verify drafts (a costly proposer's, and the cost model's re-measuring
        # step) spend an allowance of plain steps that grows by PROBE_BUDGET a step.
        self.allowance = ALLOWANCE_MAX
        self._affordable_at = 0  # the step from which the allowance covers a probe put off

    def steady(self, requests: Sequence[Request]) -> bool:
        """Whether this step may reuse the last choice without making it again: it gave
        every one of these same requests all the drafts it may verify, fewer than
        `STEADY_FOR` steps ago (while drafts pay that well, a few scored proposals do not
        turn them down, and choosing every few steps cost a batch-1 step more than the
        choices changed). Each then verifies all it may now: a request's limit only
        falls as it nears its end, and fewer drafts than a choice of all still pay. The
        caller need not report the step's proposals (`proposed`): `observe` reads each
        outcome off the step."""
        if self._steady_until <= self.step or self._steady_requests != requests:  # requests compare by identity
            return False
        self.shadowed = 0
        return True

    def quiet(self, num_running: int) -> bool:
        """Whether this step drafts nothing and asks nobody, known without looking at
        the requests: the last choice was that for the same `num_running` requests
        (all decoding), no request was released and no unverified draft was accepted
        since, and no wait ends yet."""
        return num_running == self._quiet_size and self.step < self._next_ask

    def quiet_passes(self) -> int:
        """In a quiet step: the decode passes it may run as one burst (multi-step
        decoding), up to the step on which a request is asked again."""
        return max(1, self._next_ask - self.step)

    def choose(self, requests: Sequence[Request], limits: Sequence[int],
               everyone: bool = False) -> tuple[list[int], list[bool]]:
        """Drafts each request verifies this step (at most its limit), and whether the
        proposer is asked for it (also to score drafts nobody verifies, or to probe).
        `everyone`: these are all the running requests (none is prefilling)."""
        if self._held:
            self._count_held()
        if self.probing:
            self.probing = set()
        self.shadowed = 0
        self._quiet_size = None
        due = self.costs.due(len(requests))
        if due == "warm up":
            counts, asks = self._warm_up(len(requests), limits)
        elif due == "plain" and not any(seeded_sampling(r) for r in requests):
            counts, asks = [0] * len(requests), [False] * len(requests)  # a plain step renews the base
        elif due == "drafts" and self._spend(_extra_steps(self.costs.costs(len(requests)), 0, sum(limits))):
            counts, asks = list(limits), [True] * len(requests)  # a step with drafts measures them anew
        else:
            counts = self._best_counts(requests, limits)
            asks = self._asks(requests, limits, counts)
            if everyone and not any(counts):
                self._quiet_size, self._quiet_limit, self._quiet_positions = len(requests), max(limits), sum(limits)
                self._next_ask = max(self._first_due(requests), self._affordable_at)
            elif everyone and counts == list(limits) and not self.probing:
                self._steady_requests = list(requests)
                self._steady_until = self.step + STEADY_FOR
        for i, request in enumerate(requests):
            if seeded_sampling(request):
                # A seeded sample's draws depend on its drafts; drafts chosen from measured
                # times would make its output differ run to run. It drafts as under `fixed`.
                counts[i], asks[i] = limits[i], True
                self._quiet_size = None
        return counts, asks

    def _first_due(self, requests: Sequence[Request]) -> int:
        """The first step after this one on which `_due` holds for any of `requests`."""
        return min((self._due_at(self.pauses[r.request_id]) for r in requests), default=self.step + 1)

    def _due_at(self, pause: _Pause) -> int:
        """The first step after this one on which the wait of `pause` ends."""
        every = min(pause.wait, SHADOW_AFTER_MAX)
        return cdiv(max(pause.last_asked + pause.wait, self.step + 1), every) * every

    def _warm_up(self, num_requests: int, limits: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Counts that show the cost model plain steps, full drafts and half drafts. Once
        another batch size is measured, a step with drafts here is a probe: it waits for
        the allowance, at what drafts cost at the nearest measured batch size (a batch
        size passed through briefly, as a batch drains, then costs little)."""
        phase = self.step % WARM_UP_CYCLE
        plain = [0] * num_requests, [False] * num_requests
        if phase == 0 and self.costs.needs_steps_without_drafts(num_requests):
            return plain
        counts = [max(1, limit // 2) for limit in limits] if phase == 2 else list(limits)
        stand_in = self.costs.stand_in(num_requests)
        if stand_in is not None and not self._spend(_extra_steps(stand_in, 0, sum(counts))):
            return plain
        return counts, [True] * num_requests

    @property
    def _shortest_wait(self) -> int:
        return 1 if self.cheap_proposer else PROBE_AFTER

    def _best_counts(self, requests: Sequence[Request], limits: Sequence[int]) -> list[int]:
        """`best_draft_counts` for these requests; the last answer again while the
        requests, their limits and the cost estimate stay the same, for up to
        `RECHOOSE_EVERY` steps unless a request's unverified draft would have been
        accepted (one scored proposal moves an estimate by a tenth at most, and choosing
        every step cost a batch-1 step more than the choices changed)."""
        key = (tuple(r.request_id for r in requests), tuple(limits), self.costs.fits, self.step // RECHOOSE_EVERY,
               self._hits)
        if key != self._last_key:
            costs = self.costs.costs(len(requests))
            gains = [self.acceptance.gains(r.request_id, limit) for r, limit in zip(requests, limits)]
            if may_pay(max((row[0] for row in gains if row), default=0.0), sum(limits), len(requests), costs):
                counts = best_draft_counts(gains, costs)
            else:
                counts = [0] * len(requests)
            self._last_key, self._last_counts = key, counts
        return list(self._last_counts)

    def _asks(self, requests: Sequence[Request], limits: Sequence[int], counts: list[int]) -> list[bool]:
        """Whether the proposer is asked for each request: those that draft, and those
        whose wait ends (`_due`); under a costly proposer the latter are probes, which
        draft their limit (in `counts`) as far as the probe allowance covers them."""
        asks = [False] * len(requests)
        due = []
        for i, request in enumerate(requests):
            if counts[i]:
                self._asked(request.request_id, drafting=True)
                asks[i] = True
            elif self._due(request.request_id):
                due.append(i)
        self._affordable_at = 0
        if self.cheap_proposer:
            # Shadow drafts: scored, never verified; asking and scoring them is paid from
            # the allowance (at a large batch, asking every request costs a good part of a
            # step); until it covers them, they stay due.
            cost = len(due) * self.ask_seconds / self.costs.costs(len(requests)).base if due else 0.0
            if due and not self._spend(cost):
                self._wait_for(cost)
                return asks
            for i in due:
                self._asked(requests[i].request_id, drafting=False)
                asks[i] = True
            self.shadowed = len(due)
            return asks
        costs, drafting, taken = self.costs.costs(len(requests)), sum(counts), 0
        for i in due:
            need = _extra_steps(costs, drafting, taken + limits[i])
            if not self._affords(need):
                self._wait_for(need)  # this one and the rest (their waits stay as they are)
                break
            taken += limits[i]
            counts[i] = limits[i]  # a probe: verified, and its outcome replaces the old estimate
            self.probing.add(requests[i].request_id)
            self._asked(requests[i].request_id, drafting=False)
            asks[i] = True
        if taken:
            self._spend(_extra_steps(costs, drafting, taken))
        return asks

    def _due(self, request_id: str) -> bool:
        """Whether the wait of a request that drafts nothing ends on this step. A request
        seen for the first time: a cheap proposer is asked at once (its drafts are only
        scored); a costly one waits as after a step without drafts, since a probe costs a
        catch-up run of the draft over the whole prompt, and the request starts from the
        engine's acceptance rate meanwhile (drafting at once where that pays)."""
        pause = self.pauses.get(request_id)
        if pause is None:
            self.pauses[request_id] = _Pause(self.step, self._shortest_wait, first=self.cheap_proposer)
            return self.cheap_proposer
        return (self.step - pause.last_asked >= pause.wait
                and not self.step % min(pause.wait, SHADOW_AFTER_MAX))

    def _asked(self, request_id: str, drafting: bool) -> None:
        """The request is asked on this step: its wait starts short again when it drafts,
        and doubles when it was asked only to score or probe (not on its first step)."""
        pause = self.pauses.get(request_id)
        if pause is None:
            self.pauses[request_id] = _Pause(self.step, self._shortest_wait, self.acceptance.of(request_id).hits,
                                             drafting=drafting)
            return
        if drafting:  # as a new _Pause, in place
            pause.last_asked, pause.wait, pause.first = self.step, self._shortest_wait, False
            pause.hits, pause.drafting = self.acceptance.of(request_id).hits, True
            return
        pause.drafting = False
        if pause.first:
            pause.first = False
        else:
            pause.last_asked = self.step
            pause.wait = min(2 * pause.wait, SHADOW_AFTER_MAX if self.cheap_proposer else PROBE_AFTER_MAX)

    def _wait_for(self, extra_steps: float) -> None:
        """Asks that cost `extra_steps` plain steps wait for the allowance: the first
        step it covers them (`_affords`) is `_affordable_at`."""
        short = min(extra_steps, ALLOWANCE_MAX) - self.allowance
        self._affordable_at = self.step + 1 + int(short / PROBE_BUDGET)

    def _affords(self, extra_steps: float) -> bool:
        """Whether the probe allowance covers a probe that costs `extra_steps` plain
        steps (one dearer than the allowance can ever hold goes when it is full)."""
        return self.allowance >= min(extra_steps, ALLOWANCE_MAX)

    def _spend(self, extra_steps: float) -> bool:
        """Take `extra_steps` from the allowance if it `_affords` them (it may go below 0:
        a debt the next steps pay back)."""
        if not self._affords(extra_steps):
            return False
        self.allowance -= extra_steps
        return True

    def proposed(self, request: Request, token_ids: Sequence[int], num_verified: int = 0) -> None:
        """The proposer's drafts for `request` this step (all it proposed), of which the
        step verifies the first `num_verified`. A proposal verified whole is counted from
        the step's outcome (`observe`); one that is not is kept to score against the
        tokens that follow."""
        fresh = request.request_id in self.probing
        if token_ids and num_verified >= len(token_ids):
            self._verifying.append((request, request.num_tokens, fresh))
        else:
            self.acceptance.propose(request, token_ids, fresh)

    @property
    def ask_seconds(self) -> float:
        """Seconds asking a cheap proposer for one request's shadow drafts costs, with scoring them."""
        return self.propose_seconds + self.score_seconds

    def asked(self, num_requests: int, seconds: float) -> None:
        """The proposer was asked for `num_requests` requests this step, and drafting took
        `seconds` (the choice and the checks with it)."""
        self.propose_seconds += ASK_COST_WEIGHT * (seconds / num_requests - self.propose_seconds)
        self._time_scoring = True

    def observe(self, scheduled: Sequence[ScheduledRequest] = (), passes: int = 1) -> None:
        """After a step (`scheduled`, its result applied): count the proposals it verified
        whole (held to the end of a steady window) and score the others now decided
        (timed after a step that asked for shadow drafts, for `ask_seconds`). A step
        that ran `passes` decode passes (a burst) counts as that many steps."""
        self._passes = passes
        if not (self._held or self._verifying or self.acceptance.waiting) and self.step >= self._steady_until:
            self._stepped()  # nothing to count or score: most steps of a batch that drafts nothing
            return
        if self.step < self._steady_until:
            # A steady window verifies every proposal whole, none fresh (`steady`): each
            # outcome is read off its request's entry, and held while nothing is pending.
            self._verifying.clear()
            self._held += [_outcome(e) for e in scheduled if e.draft_token_ids and not e.request.finished]
            if not self.acceptance.waiting:
                self._stepped()
                return
        if self._held:
            self._count_held()
        verified = self._count(self._verified_outcomes(scheduled)) if self._verifying else []
        if not self._time_scoring or not self.acceptance.waiting:
            self._observed(verified + self.acceptance.score_pending() if self.acceptance.waiting else verified)
            return
        self._time_scoring = False
        start = self.clock()
        scored = self.acceptance.score_pending()
        if scored:
            self.score_seconds += ASK_COST_WEIGHT * ((self.clock() - start) / len(scored) - self.score_seconds)
        self._observed(verified + scored)

    def _verified_outcomes(self, scheduled: Sequence[ScheduledRequest]) -> list[tuple[str, int, int, bool]]:
        """The outcomes (`_outcome`, and whether each restarts its request's estimate) of
        the proposals this step verified whole. A request that ended in the step, or
        whose drafts were not scheduled in it, counts nothing."""
        verifying, self._verifying = self._verifying, []
        entries = {e.request.request_id: e for e in scheduled if e.draft_token_ids}
        outcomes = []
        for request, start, fresh in verifying:
            entry = entries.get(request.request_id)
            if entry is not None and entry.start + 1 == start and not request.finished:
                outcomes.append((*_outcome(entry), fresh))
        return outcomes

    def _count(self, outcomes: Sequence[tuple[str, int, int, bool]]) -> list[tuple[RequestAcceptance, str]]:
        """Count verified outcomes into the estimates; the states they changed, with their ids."""
        verified = self.acceptance.verified
        return [(verified(request_id, accepted, scored, fresh), request_id)
                for request_id, accepted, scored, fresh in outcomes]

    def _count_held(self) -> None:
        """Count a steady window's held outcomes, as if each had been counted on its step
        (the requests drafted throughout, so only their hits are noted)."""
        held, self._held = self._held, []
        self._note_hits(self.acceptance.verified_all(held))

    def _observed(self, scored) -> None:
        self._note_hits(scored)
        self._stepped()

    def _stepped(self) -> None:
        self.allowance = min(self.allowance + PROBE_BUDGET * self._passes, ALLOWANCE_MAX)
        self.step += self._passes

    def _note_hits(self, scored) -> None:
        for state, request_id in scored:
            pause = self.pauses.get(request_id)
            if pause is not None and state.hits > pause.hits:
                # a draft would have been accepted: under a cheap proposer look again sooner
                # (under a costly one the probe's outcome is the estimate, which decides), and
                # choose again if its drafts may pay now (a miss only lowers estimates)
                pause.hits = state.hits
                self._hits += not pause.drafting  # one that drafted nothing may pay now: choose again
                if self.cheap_proposer:
                    pause.wait = max(self._shortest_wait, pause.wait // 2)
                self._hit(request_id, pause)

    def _hit(self, request_id: str, pause: _Pause) -> None:
        """A quiet batch stays quiet after a hit unless the request's new estimate may
        pay (`may_pay` on its gain alone; the choice over the batch comes when it is
        next asked, at the earliest on its shortened wait)."""
        if self._quiet_size is None:
            return
        gains = self.acceptance.gains(request_id, self._quiet_limit)
        if gains and may_pay(gains[0], self._quiet_positions, self._quiet_size, self.costs.costs(self._quiet_size)):
            self._quiet_size = None
        else:
            self._next_ask = min(self._next_ask, self._due_at(pause))

    def timed(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """A pure-decode step of `num_requests` with `num_drafts` drafts took `seconds`."""
        self.costs.observe(num_requests, num_drafts, seconds)

    def release(self, request_id: str) -> None:
        if self._held:
            self._count_held()
        self._quiet_size = None
        self._steady_until, self._steady_requests = 0, []
        self.acceptance.release(request_id)
        self.pauses.pop(request_id, None)
