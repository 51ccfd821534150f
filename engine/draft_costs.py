"""What a step with drafts costs, measured as the engine runs, and how many drafts pay.

`StepCostModel` fits the seconds of pure-decode steps (every request one known
token plus its drafts) as

    seconds = fixed + per_request * requests + per_draft * drafts + verify * (drafts > 0)

by least squares over recent steps (timed by `step_clock`; a step slower than 1.5 times the fit's
expectation counts as that: other work on the machine stalls steps now and then,
and least squares would chase the stalls): `verify` is what a step pays once for
verifying any drafts at all (the rejection sampler, the multi-token attention
path), `per_draft` what each draft row adds (its forward, and a draft model's
run when it is timed inside the step). Steps without drafts and steps with them
are kept in two separately decayed sums, each fading only as new steps of its
own kind arrive: a long stretch without drafts does not forget what drafts
cost. Being measured on the running engine, it holds for any machine and model.

`best_draft_counts` picks how many drafts each request verifies to maximise
expected tokens per second of the step, given each request's expected gain per
draft (`draft_acceptance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import time

import numpy as np
import torch

DECAY = 0.995  # per step of the same kind: about the last 200 steps of each kind count (steps are noisy)
MIN_WEIGHT = 2.0  # steps of each kind (decayed) before the fit is trusted
OUTLIER = 1.5
REFIT_EVERY = 8  # steps between solving the fit again (it moves slowly; solving costs tens of µs)


def step_clock(device: torch.device):
    """The clock steps are timed with: on CPU the process's CPU time, so a step
    that other work on the machine held up is not charged for the wait (with one
    torch thread it is the step's own work; with more, all of theirs); on an
    accelerator wall time, which is what its steps cost."""
    return time.process_time if torch.device(device).type == "cpu" else time.perf_counter


def _outer(x: Sequence[float]) -> list[float]:
    """x xᵀ, flattened row by row."""
    return [a * b for a in x for b in x]


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at a given batch: `base` without drafts, plus `verify`
    once when any request drafts, plus `per_draft` for each draft."""

    base: float
    per_draft: float
    verify: float

    def seconds(self, num_drafts: int) -> float:
        return self.base + (self.verify + self.per_draft * num_drafts if num_drafts else 0.0)


class StepCostModel:
    """Online least-squares fit of decode-step seconds to requests and drafts."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        # [without drafts, with drafts]: decayed sums of x xᵀ (flat, 16 entries), of
        # x · seconds and of weights; plain floats, since a step's update must cost µs
        self.gram = [[0.0] * 16 for _ in range(2)]
        self.moment = [[0.0] * 4 for _ in range(2)]
        self.weight = [0.0, 0.0]
        self._fit: list[float] | None = None
        self._since_fit = 0
        self.fits = 0  # how many times the fit was solved: a changed fit may change the best drafts

    @property
    def ready(self) -> bool:
        """Whether enough steps of both kinds were seen to tell what drafts cost."""
        return min(self.weight) >= MIN_WEIGHT

    def needs_steps_without_drafts(self) -> bool:
        return self.weight[0] < MIN_WEIGHT

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """One pure-decode step's measured seconds."""
        kind = 1 if num_drafts else 0
        x = (1.0, float(num_requests), float(num_drafts), float(kind))
        if self.weight[kind] >= 1:
            # A loaded machine stalls some steps many times over; least squares would chase
            # them, so a step counts as at most OUTLIER times what the fit expects.
            expected = sum(c * v for c, v in zip(self.coefficients(), x))
            seconds = min(seconds, OUTLIER * max(expected, 1e-9))
        decay = self.decay
        self.gram[kind] = [g * decay + p for g, p in zip(self.gram[kind], _outer(x))]
        self.moment[kind] = [m * decay + a * seconds for m, a in zip(self.moment[kind], x)]
        self.weight[kind] = self.weight[kind] * self.decay + 1.0
        self._since_fit += 1
        if self._fit is None or self._since_fit >= REFIT_EVERY or not self.ready:
            self._fit = None

    def coefficients(self) -> list[float]:
        """`[fixed, per_request, per_draft, verify]` seconds (a faint ridge settles the
        directions the steps seen do not: e.g. always one request)."""
        if self._fit is None:
            gram = (np.array(self.gram[0]) + np.array(self.gram[1])).reshape(4, 4)
            ridge = 1e-6 * float(np.trace(gram)) / 4 + 1e-12
            self._fit = np.linalg.solve(gram + ridge * np.eye(4),
                                        np.array(self.moment[0]) + np.array(self.moment[1])).tolist()
            self._since_fit = 0
            self.fits += 1
        return self._fit

    def costs(self, num_requests: int) -> StepCosts:
        fixed, per_request, per_draft, verify = self.coefficients()
        base = fixed + per_request * num_requests
        floor = 1e-9  # a fit on noisy steps may dip below zero; no step is free
        return StepCosts(max(base, floor), max(per_draft, 0.0), max(verify, 0.0))


def best_draft_counts(gains: Sequence[Sequence[float]], costs: StepCosts) -> list[int]:
    """Drafts per request maximising expected tokens per second of one step.

    `gains[r][j]` is the expected tokens request r's draft j + 1 adds (non-increasing
    in j); every request emits one token anyway. Every draft costs the same, so the
    best step takes the drafts of highest gain first: it is one of the prefixes of
    all drafts sorted by gain, each is scored and the best kept (the fewest drafts
    on a tie). Ties at the cut go to the earlier requests."""
    ranked = sorted((g for row in gains for g in row), reverse=True)
    tokens = float(len(gains))
    best_rate, best_n = tokens / costs.seconds(0), 0
    seconds, last_rate = costs.base + costs.verify, 0.0
    for n, gain in enumerate(ranked, start=1):
        tokens += gain
        seconds += costs.per_draft
        rate = tokens / seconds
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_n = rate, n
        elif rate < last_rate:
            # Past one draft the rate only falls once it falls: a draft that adds less
            # than the step's average makes the average lower, and the next adds less.
            break
        last_rate = rate
    if not best_n:
        return [0] * len(gains)
    cut = ranked[best_n - 1]
    counts = [sum(1 for g in row if g > cut) for row in gains]
    ties = best_n - sum(counts)
    for r, row in enumerate(gains):  # a row's drafts at the cut come after its higher ones: a prefix still
        take = min(ties, sum(1 for g in row if g == cut))
        counts[r] += take
        ties -= take
    return counts
