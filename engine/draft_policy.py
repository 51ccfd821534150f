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
   per second, which may be none for some requests, or for all.

While the cost model lacks steps at this batch size (a new engine, or a batch
size not seen yet), requests draft as many as allowed, except that one step in
`WARM_UP_CYCLE` drafts nothing until plain steps are known and another drafts
half as many, so the model sees how the cost grows with the drafts.

A request that drafts nothing must be able to start again when its text becomes
predictable, so it keeps being *probed*, at waits that double while drafting
does not pay (start short again when it does, and halve when one of its
unverified drafts would have been accepted):

* a cheap proposer (`SpeculativeProposer.cheap`, e.g. `ngram`) is asked for it
  every 1, 2, 4, then `SHADOW_AFTER_MAX` steps, and its would-be drafts are scored
  against the tokens that follow (shadow drafts): no verification cost;
* a proposer that runs a model is not asked for it, except that after 16, 32, ...
  up to `PROBE_AFTER_MAX` steps it verifies a full draft once, whose outcome
  replaces the request's old estimate.

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

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.core import cdiv

from .draft_acceptance import AcceptanceTracker
from .draft_costs import StepCostModel, best_draft_counts, may_pay
from .request import Request

DRAFT_POLICIES = ("adaptive", "fixed")
WARM_UP_CYCLE = 4  # while costs are unknown: a plain step (until known), full, half, full
SHADOW_AFTER_MAX = 8
PROBE_AFTER = 16
PROBE_AFTER_MAX = 128


def _seeded(request: Request) -> bool:
    """A sampled request with its own seed: it drafts as under `fixed` (module docstring)."""
    return request.generator is not None and not request.params.greedy


@dataclass
class _Pause:
    """When a request that drafts nothing is next asked for drafts."""

    last_asked: int
    wait: int
    hits: int = 0  # its acceptance's `hits` when last seen: a new hit shortens the wait


class AdaptiveDraftPolicy:
    """Per-request draft counts from acceptance and measured cost (module docstring)."""

    def __init__(self, *, cheap_proposer: bool):
        self.cheap_proposer = cheap_proposer
        self.acceptance = AcceptanceTracker()
        self.costs = StepCostModel()
        self.pauses: dict[str, _Pause] = {}
        self.step = 0
        self.probing: set[str] = set()  # request ids whose proposal this step restarts their estimate
        self._last_key: tuple | None = None
        self._last_counts: list[int] = []
        # A quiet batch: every running request decodes, none drafts, none is due to be asked
        # before `_next_ask`; until then (or until something changes) `quiet` skips the step.
        self._quiet_size: int | None = None
        self._next_ask = 0

    def quiet(self, num_running: int) -> bool:
        """Whether this step drafts nothing and asks nobody, known without looking at
        the requests: the last choice was that for the same `num_running` requests
        (all decoding), no request was released and no unverified draft was accepted
        since, and no wait ends yet."""
        return num_running == self._quiet_size and self.step < self._next_ask

    def choose(self, requests: Sequence[Request], limits: Sequence[int],
               everyone: bool = False) -> tuple[list[int], list[bool]]:
        """Drafts each request verifies this step (at most its limit), and whether the
        proposer is asked for it (also to score drafts nobody verifies, or to probe).
        `everyone`: these are all the running requests (none is prefilling)."""
        self.probing = set()
        self._quiet_size = None
        if not self.costs.ready(len(requests)):
            counts, asks = self._warm_up(len(requests), limits)
        elif self.costs.stale(len(requests)) and not any(_seeded(r) for r in requests):
            counts, asks = [0] * len(requests), [False] * len(requests)  # a plain step renews the base
        elif self.costs.probe_due(len(requests)):
            counts, asks = list(limits), [True] * len(requests)  # a step with drafts measures them anew
        else:
            counts = self._best_counts(requests, limits)
            asks = []
            for i, (request, limit) in enumerate(zip(requests, limits)):
                ask = self._ask(request.request_id, counts[i])
                if ask and not counts[i] and not self.cheap_proposer:
                    counts[i] = limit  # a probe: verified, and its outcome replaces the old estimate
                    self.probing.add(request.request_id)
                asks.append(ask)
            if everyone and not any(counts):
                self._quiet_size, self._next_ask = len(requests), self._first_due(requests)
        for i, request in enumerate(requests):
            if _seeded(request):
                # A seeded sample's draws depend on its drafts; drafts chosen from measured
                # times would make its output differ run to run. It drafts as under `fixed`.
                counts[i], asks[i] = limits[i], True
                self._quiet_size = None
        return counts, asks

    def _first_due(self, requests: Sequence[Request]) -> int:
        """The first step after this one on which `_ask` asks any of `requests`."""
        first = None
        for request in requests:
            pause = self.pauses[request.request_id]
            every = min(pause.wait, SHADOW_AFTER_MAX)
            due = cdiv(max(pause.last_asked + pause.wait, self.step + 1), every) * every
            first = due if first is None else min(first, due)
        return self.step + 1 if first is None else first

    def _warm_up(self, num_requests: int, limits: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Counts that show the cost model plain steps, full drafts and half drafts."""
        phase = self.step % WARM_UP_CYCLE
        if phase == 0 and self.costs.needs_steps_without_drafts(num_requests):
            return [0] * num_requests, [False] * num_requests
        if phase == 2:
            return [max(1, limit // 2) for limit in limits], [True] * num_requests
        return list(limits), [True] * num_requests

    @property
    def _shortest_wait(self) -> int:
        return 1 if self.cheap_proposer else PROBE_AFTER

    def _best_counts(self, requests: Sequence[Request], limits: Sequence[int]) -> list[int]:
        """`best_draft_counts` for these requests; the last answer again while neither the
        requests, nor their limits, nor any estimate changed."""
        key = (tuple(r.request_id for r in requests), tuple(limits), self.acceptance.changes, self.costs.fits)
        if key != self._last_key:
            costs = self.costs.costs(len(requests))
            gains = [self.acceptance.gains(r.request_id, limit) for r, limit in zip(requests, limits)]
            if may_pay(max((row[0] for row in gains if row), default=0.0), sum(limits), len(requests), costs):
                counts = best_draft_counts(gains, costs)
            else:
                counts = [0] * len(requests)
            self._last_key, self._last_counts = key, counts
        return list(self._last_counts)

    def _ask(self, request_id: str, count: int) -> bool:
        pause = self.pauses.get(request_id)
        if pause is None:
            # Its first step: a cheap proposer is asked at once (its drafts are only scored);
            # a costly one waits as after a step without drafts, since a probe costs a
            # catch-up run of the draft over the whole prompt, and the request starts from
            # the engine's acceptance rate meanwhile (drafting at once where that pays).
            self.pauses[request_id] = _Pause(self.step, self._shortest_wait)
            return self.cheap_proposer or bool(count)
        if count:
            pause.last_asked, pause.wait = self.step, self._shortest_wait
            return True
        if self.step - pause.last_asked < pause.wait or self.step % min(pause.wait, SHADOW_AFTER_MAX):
            return False
        pause.last_asked = self.step
        pause.wait = min(2 * pause.wait, SHADOW_AFTER_MAX if self.cheap_proposer else PROBE_AFTER_MAX)
        return True

    def proposed(self, request: Request, token_ids: Sequence[int]) -> None:
        """The proposer's drafts for `request` this step (all it proposed, verified or not)."""
        self.acceptance.propose(request, token_ids, fresh=request.request_id in self.probing)

    def observe(self) -> None:
        """After a step: score the proposals now decided."""
        for state, request_id in self.acceptance.score_pending():
            pause = self.pauses.get(request_id)
            if pause is not None and state.hits > pause.hits:
                # a draft it did not verify would have been accepted: look again sooner, and
                # choose again (a miss only lowers estimates, so a quiet batch stays quiet)
                pause.hits, pause.wait = state.hits, max(self._shortest_wait, pause.wait // 2)
                self._quiet_size = None
        self.step += 1

    def timed(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """A pure-decode step of `num_requests` with `num_drafts` drafts took `seconds`."""
        self.costs.observe(num_requests, num_drafts, seconds)

    def release(self, request_id: str) -> None:
        self._quiet_size = None
        self.acceptance.release(request_id)
        self.pauses.pop(request_id, None)
