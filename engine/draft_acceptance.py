"""How likely each request's drafts are to be accepted, learned from its own recent proposals.

Every proposal a request gets is scored once the tokens it guessed are known:
how many of its leading drafts equal the tokens the request then emitted. That
is exactly what verification accepts for drafts it verified (greedy rows accept
while a draft equals the target's token; under rejection sampling a draft is
kept exactly when the emitted token equals it), and for drafts it did not verify
(a proposal cut short, or not verified at all: *shadow* drafts) it is an unbiased
stand-in: a deterministic draft `x` is accepted with probability `p(x)`, the
chance the target emits `x`. So a request that drafts nothing can still be seen
to become predictable again, at no verification cost. A proposal a step verified
whole needs no later scoring: its outcome is counted as the verifier decided it
(`verified`, or `verified_all` for several at once).

Per request and draft position `j` it keeps decayed counts of drafts scored and
accepted given the `j - 1` before were. A request's rate at `j` is pulled toward
the engine's rate there (every request's outcomes, fading slower), which is pulled
toward one half: a new request starts from what the others saw, and its own
outcomes take over within a few proposals. A request's counts fade by `decay`
per scored proposal (about one per step), so a request that changes character is
followed within about ten proposals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .request import Request, token_slice

PRIOR_RATE = 0.5  # the engine's rate before any evidence
PRIOR_WEIGHT = 2.0  # pseudo-drafts pulling a rate toward its prior
PRIOR_REFRESH = 32  # scored proposals between reading the engine's rates again
RESCALE_ABOVE = 1e100  # a `RequestAcceptance.scale` past this is folded back into its counts


@dataclass
class _Pending:
    start: int  # the request's token count when proposed: draft i guesses token start + i
    token_ids: list[int]
    fresh: bool  # its outcome starts the request's counts afresh (a probe after a long pause)


@dataclass
class RequestAcceptance:
    """One request's decayed counts per draft position and its proposals not yet scored."""

    # Decayed counts per draft position, each held times `scale` (one factor fades every
    # position at once: counting an outcome touches only the positions it reached).
    scored: list[float] = field(default_factory=list)  # drafts at position j+1 scored (earlier ones accepted)
    accepted: list[float] = field(default_factory=list)  # of those, accepted
    scale: float = 1.0
    pending: list[_Pending] = field(default_factory=list)
    hits: int = 0  # scored proposals whose first draft was accepted
    counted: int = 0  # scored proposals: its rates change only when this grows
    cached_key: tuple | None = None  # what `cached_gains` were computed from
    cached_gains: list[float] = field(default_factory=list)

    def count(self, num_accepted: int, num_scored: int, decay: float) -> None:
        """One proposal's outcome: its first `num_accepted` of `num_scored` drafts matched
        (the one after them, if scored, did not); earlier outcomes fade by `decay`."""
        self.count_all(((num_accepted, num_scored),), decay)

    def count_all(self, outcomes: Sequence[tuple[int, int]], decay: float) -> None:
        """Proposals' outcomes (`count`'s two numbers each), oldest first: the same counts
        as counting them one by one, in one pass."""
        scored, accepted, scale = self.scored, self.accepted, self.scale
        for num_accepted, num_scored in outcomes:
            if num_scored > len(scored):
                scored += [0.0] * (num_scored - len(scored))
                accepted += [0.0] * (num_scored - len(accepted))
            scale /= decay  # every count held fades by `decay`
            if scale > RESCALE_ABOVE:
                scored[:] = [x / scale for x in scored]
                accepted[:] = [x / scale for x in accepted]
                scale = 1.0
            for j in range(num_scored):
                scored[j] += scale
            for j in range(num_accepted):
                accepted[j] += scale
            self.hits += num_accepted > 0
        self.scale = scale
        self.counted += len(outcomes)

    def rates(self, num_positions: int, prior: Sequence[float]) -> list[float]:
        """Estimated chance that draft j + 1 is accepted given the j before it were,
        pulled toward `prior[j]` (what all requests saw there)."""
        rates, scale = [], self.scale
        for j in range(num_positions):
            scored = self.scored[j] / scale if j < len(self.scored) else 0.0
            accepted = self.accepted[j] / scale if j < len(self.accepted) else 0.0
            rates.append((accepted + prior[j] * PRIOR_WEIGHT) / (scored + PRIOR_WEIGHT))
        return rates

    def gains(self, num_positions: int, prior: Sequence[float]) -> list[float]:
        """Expected tokens draft j + 1 adds: the chance the first j + 1 are all accepted
        (non-increasing in j)."""
        gains, together = [], 1.0
        for rate in self.rates(num_positions, prior):
            together *= rate
            gains.append(together)
        return gains


class AcceptanceTracker:
    """Every running request's `RequestAcceptance`, by request id."""

    def __init__(self, decay: float = 0.9, engine_decay: float = 0.98):
        self.decay = decay
        self.requests: dict[str, RequestAcceptance] = {}
        self.engine = RequestAcceptance()  # every request's outcomes, fading slower: the prior of each
        self.engine_decay = engine_decay
        self.changes = 0  # proposals scored so far: estimates change only when it grows
        self.waiting: dict[str, Request] = {}  # requests with proposals not scored yet
        self._prior: list[float] | None = None  # the engine's rates, refreshed every PRIOR_REFRESH scores
        self._prior_version = 0

    def gains(self, request_id: str, num_positions: int) -> list[float]:
        """The request's expected tokens per draft position (`RequestAcceptance.gains`),
        computed again only when its counts or the engine's prior changed."""
        state = self.of(request_id)
        if self._prior is None or len(self._prior) < num_positions:
            self._prior = self.engine.rates(num_positions, [PRIOR_RATE] * num_positions)
            self._prior_version += 1
        key = (num_positions, self._prior_version, state.counted)
        if state.cached_key != key:
            state.cached_key, state.cached_gains = key, state.gains(num_positions, self._prior)
        return state.cached_gains

    def of(self, request_id: str) -> RequestAcceptance:
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = RequestAcceptance()
        return state

    def propose(self, request: Request, token_ids: Sequence[int], fresh: bool = False) -> None:
        """Remember a proposal for `request` made now (at its current length), to score
        it later; a `fresh` one's outcome replaces what was counted before (evidence
        from before a long pause says little about the text now)."""
        if token_ids:
            self.of(request.request_id).pending.append(_Pending(request.num_tokens, list(token_ids), fresh))
            self.waiting[request.request_id] = request

    def score_pending(self) -> list[tuple[RequestAcceptance, str]]:
        """Score every request with proposals pending (`score`); the states that
        counted an outcome, with their request ids. Requests without pending
        proposals cost nothing here."""
        counted = []
        for request_id, request in list(self.waiting.items()):
            state = self.requests.get(request_id)
            before = -1 if state is None else state.counted
            self.score(request)
            state = self.requests.get(request_id)
            if state is None or not state.pending:
                del self.waiting[request_id]
            if state is not None and state.counted != before:
                counted.append((state, request_id))
        return counted

    def score(self, request: Request) -> None:
        """Score the request's pending proposals against its tokens now; those not
        decided yet stay pending."""
        state = self.requests.get(request.request_id)
        if state is None or not state.pending:
            return
        known = request.num_tokens
        still = []
        for proposal in state.pending:
            drafts = proposal.token_ids
            seen = min(len(drafts), known - proposal.start)
            actual = token_slice(request, proposal.start, proposal.start + seen) if seen > 0 else []
            matched = 0
            while matched < seen and drafts[matched] == actual[matched]:
                matched += 1
            if matched < seen or seen == len(drafts):  # decided (a mismatch: the rest is never reached)
                self._count(state, matched, min(matched + 1, len(drafts)), proposal.fresh)
            else:
                still.append(proposal)
        state.pending = still

    def verified(self, request_id: str, num_accepted: int, num_scored: int, fresh: bool = False) -> RequestAcceptance:
        """Count the outcome of a proposal a step verified, as its verifier decided it:
        its first `num_accepted` of `num_scored` drafts accepted (kept nowhere to be
        scored against the tokens later). Returns the request's state."""
        state = self.of(request_id)
        self._count(state, num_accepted, num_scored, fresh)
        return state

    def verified_all(self, outcomes: Sequence[tuple[str, int, int]]) -> list[tuple[RequestAcceptance, str]]:
        """`verified` for several proposals' outcomes, (request id, accepted, scored),
        oldest first, none fresh, in one pass per request: the same counts as one by one.
        Returns each request's state once, with its id."""
        by_request: dict[str, list[tuple[int, int]]] = {}
        for request_id, num_accepted, num_scored in outcomes:
            by_request.setdefault(request_id, []).append((num_accepted, num_scored))
        states = []
        for request_id, counts in by_request.items():
            state = self.of(request_id)
            state.count_all(counts, self.decay)
            states.append((state, request_id))
        self.engine.count_all([(a, s) for _, a, s in outcomes], self.engine_decay)
        self._counted(len(outcomes))
        return states

    def _count(self, state: RequestAcceptance, num_accepted: int, num_scored: int, fresh: bool) -> None:
        """One decided proposal into the request's counts (afresh if `fresh`) and the engine's."""
        if fresh:
            state.scored, state.accepted = [], []
        state.count(num_accepted, num_scored, self.decay)
        self.engine.count(num_accepted, num_scored, self.engine_decay)
        self._counted(1)

    def _counted(self, num_proposals: int) -> None:
        """The engine's prior is read again once `PRIOR_REFRESH` more proposals are counted."""
        before, self.changes = self.changes, self.changes + num_proposals
        if before // PRIOR_REFRESH != self.changes // PRIOR_REFRESH:
            self._prior = None

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.waiting.pop(request_id, None)
