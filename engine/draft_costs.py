"""What a step with drafts costs, measured as the engine runs, and how many drafts pay.

`StepCostModel` keeps, per batch-size bucket (1, 2-3, 4-7, ..., 32-63, ...), a
window of its most recent pure-decode steps (every request one known token plus
its drafts), timed from proposing to the applied result (the forward, the
verification and a draft model's run when it is timed inside the step):

* plain steps (no drafts): the median of the last few is what a step costs
  now (`base`); a batch that drafts on every step is asked for one plain step
  in `PLAIN_REFRESH` timed ones, so the base does not drift from the steps measured
  against it, and a batch that drafts nothing for `COST_PROBE_EVERY` steps
  drafts on one, so an estimate that once turned drafts down can be revised
  (`due`);
* steps with drafts, each kept as its *ratio* to the plain median of the
  moment: a load that slows every step alike leaves the ratios unchanged, so
  what drafts cost relative to a plain step holds while the load swings.

From the ratios it estimates `ratio(D) = 1 + verify + per_draft · D` robustly:
a first line through the medians of the steps with fewer and with more drafts
than the window's median count marks the steps far off it (stalled by other
work on the machine), and a least-squares line through the rest is the
estimate; when every step kept verified the same number of drafts (no slope to
see), all of the extra is charged to `verify`, which overstates what fewer
drafts cost rather than understating it. Buckets are kept apart because a
draft's relative cost depends on the batch (at batch 1 a verify step reads the
weights once for several tokens; at 32 decode is compute-bound and each draft
is another row). Being measured on the running engine, it holds for any
machine, model and proposer. `stand_in` gives the nearest measured bucket's
costs, to price warming up a bucket not yet measured.

`best_draft_counts` picks how many drafts each request verifies to maximise
expected tokens per second of the step, given each request's expected gain per
draft (`draft_acceptance`); `may_pay` says, from the largest gain alone, whether
any drafts could, so that a batch where none can skips the choice.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import torch

WINDOW = 32  # steps with drafts kept per bucket
PLAIN_WINDOW = 9  # plain steps kept per bucket: a short window, so the base follows the load within a few
MIN_PLAIN = 4  # plain steps in a bucket before its base is trusted
MIN_DRAFTED = 8  # steps with drafts in a bucket before their cost is trusted (single steps are noisy)
COST_PROBE_EVERY = 128  # plain steps in a row after which one step drafts again, to measure drafts anew
PLAIN_REFRESH = 32  # timed steps with drafts in a row before a plain step is wanted, to keep the base current
# Drafts are verified only where the estimate says they raise tokens per second by this
# much: a request's gains are estimated from its recent drafts, and it drafts when they
# happen to look good (so, on average, when they were overestimated), and the step after
# a verification runs slower than one after a plain step (its caches hold the larger
# step's data), which the step costs measured do not include.
MIN_GAIN = 0.05
REFIT_EVERY = 32  # steps of a bucket between estimates (one costs tens of µs; the window holds 32)


def step_clock(device: torch.device):
    """The clock steps are timed with: on CPU the process's CPU time, so a step
    that other work on the machine held up is not charged for the wait (with one
    torch thread it is the step's own work; with more, all of theirs); on an
    accelerator wall time, which is what its steps cost."""
    return time.process_time if torch.device(device).type == "cpu" else time.perf_counter


def batch_bucket(num_requests: int) -> int:
    """The bucket of a batch size: 1, 2-3, 4-7, ... share one each."""
    return max(1, num_requests).bit_length()


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at a given batch: `base` without drafts, plus `verify`
    once when any request drafts, plus `per_draft` for each draft."""

    base: float
    per_draft: float
    verify: float

    def seconds(self, num_drafts: int) -> float:
        return self.base + (self.verify + self.per_draft * num_drafts if num_drafts else 0.0)


def ratio_fit(drafted: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """`(verify, per_draft)` of `ratio = 1 + verify + per_draft · drafts` over steps
    `(drafts, ratio)`: a first fit by medians (module docstring) tells the stalled
    steps apart (off it by more than 3 times the median miss), a least-squares line
    through the others is the answer; both at least 0."""
    verify, per_draft = _median_fit(drafted)
    misses = [r - 1.0 - verify - per_draft * d for d, r in drafted]
    spread = 3 * median(abs(m) for m in misses) + 1e-3
    kept = [(d, r) for (d, r), m in zip(drafted, misses) if abs(m) <= spread]
    n = len(kept)
    mean_d, mean_r = sum(d for d, _ in kept) / n, sum(r for _, r in kept) / n
    var_d = sum((d - mean_d) ** 2 for d, _ in kept)
    if var_d <= 0:
        return max(0.0, mean_r - 1.0), 0.0  # one draft count only: all of it to verify
    per_draft = max(0.0, sum((d - mean_d) * (r - mean_r) for d, r in kept) / var_d)
    return max(0.0, mean_r - 1.0 - per_draft * mean_d), per_draft


def _median_fit(drafted: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """The slope between the medians of the steps with fewer and with more drafts than
    the median count (none: 0), and the median intercept."""
    counts = sorted(d for d, _ in drafted)
    middle = counts[len(counts) // 2]
    if middle == counts[0]:  # at least half drafted the fewest: split there
        low = [(d, r) for d, r in drafted if d == middle]
        high = [(d, r) for d, r in drafted if d > middle]
    else:
        low = [(d, r) for d, r in drafted if d < middle]
        high = [(d, r) for d, r in drafted if d >= middle]
    per_draft = 0.0
    if high:
        run = median(d for d, _ in high) - median(d for d, _ in low)
        per_draft = max(0.0, (median(r for _, r in high) - median(r for _, r in low)) / run)
    verify = max(0.0, median(r - 1.0 - per_draft * d for d, r in drafted))
    return verify, per_draft


class _Bucket:
    def __init__(self):
        self.plain: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self.drafted: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (drafts, ratio to the plain median)
        self.base: float | None = None  # the plain median; None when a plain step came since
        self.costs: StepCosts | None = None
        self.since_fit = 0
        self.since_plain = 0  # steps with drafts since the last plain one
        self.since_drafted = 0  # plain steps since the last one with drafts

    def current_base(self) -> float:
        if self.base is None:
            self.base = max(median(self.plain), 1e-9)
        return self.base


def _ready(bucket: _Bucket | None) -> bool:
    return bucket is not None and len(bucket.plain) >= MIN_PLAIN and len(bucket.drafted) >= MIN_DRAFTED


class StepCostModel:
    """Per batch bucket: recent plain steps' median, and what drafts cost relative to it."""

    def __init__(self):
        self.buckets: dict[int, _Bucket] = {}
        self.fits = 0  # estimates made so far: a changed estimate may change the best drafts

    def _bucket(self, num_requests: int) -> _Bucket:
        key = batch_bucket(num_requests)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket()
        return bucket

    def ready(self, num_requests: int) -> bool:
        """Whether enough steps of both kinds were seen at this batch to tell what drafts cost."""
        return _ready(self.buckets.get(batch_bucket(num_requests)))

    def stand_in(self, num_requests: int) -> StepCosts | None:
        """The costs of the nearest batch bucket that is `ready` (the larger on a tie,
        where drafts cost more of a step), to judge what warming up a new batch size
        costs; None when no bucket is ready yet."""
        key = batch_bucket(num_requests)
        ready = [k for k, bucket in self.buckets.items() if _ready(bucket)]
        if not ready:
            return None
        nearest = min(ready, key=lambda k: (abs(k - key), -k))
        return self.costs(1 << (nearest - 1))

    def due(self, num_requests: int) -> str | None:
        """What this batch's costs need before a choice can be trusted: "warm up" (not
        `ready`); "plain" when it drafted `PLAIN_REFRESH` steps in a row (its base, and
        so every ratio measured against it, may have drifted: longer sequences, another
        load; one plain step renews it); "drafts" when it went `COST_PROBE_EVERY` steps
        without drafts (what drafts cost was measured long ago, perhaps on a noisy
        stretch that made them look too dear ever to try again; one step with drafts
        measures it anew); else None."""
        bucket = self.buckets.get(batch_bucket(num_requests))
        if not _ready(bucket):
            return "warm up"
        if bucket.since_plain >= PLAIN_REFRESH:
            return "plain"
        if bucket.since_drafted >= COST_PROBE_EVERY:
            return "drafts"
        return None

    def needs_steps_without_drafts(self, num_requests: int) -> bool:
        bucket = self.buckets.get(batch_bucket(num_requests))
        return bucket is None or len(bucket.plain) < MIN_PLAIN

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """One pure-decode step's measured seconds."""
        bucket = self._bucket(num_requests)
        if num_drafts:
            if not bucket.plain:
                return  # nothing to compare it with yet
            bucket.drafted.append((num_drafts, seconds / bucket.current_base()))
            bucket.since_plain, bucket.since_drafted = bucket.since_plain + 1, 0
        else:
            bucket.plain.append(seconds)
            bucket.since_plain, bucket.since_drafted = 0, bucket.since_drafted + 1
            bucket.base = None  # the median again when next needed (most plain steps never need it)
        bucket.since_fit += 1
        if bucket.since_fit >= REFIT_EVERY:
            bucket.costs = None

    def costs(self, num_requests: int) -> StepCosts:
        """The costs at this batch (`ready` must hold): the plain median and the
        fitted ratios, estimated again every `REFIT_EVERY` steps of the bucket."""
        bucket = self._bucket(num_requests)
        if bucket.costs is None:
            verify, per_draft = ratio_fit(bucket.drafted)
            base = bucket.current_base()
            bucket.costs = StepCosts(base, per_draft * base, verify * base)
            bucket.since_fit = 0
            self.fits += 1
        return bucket.costs


def may_pay(max_gain: float, num_positions: int, num_requests: int, costs: StepCosts) -> bool:
    """Whether any drafts could raise tokens per second by `MIN_GAIN`, knowing only the
    largest gain of any draft and how many draft positions there are: n drafts add at
    most n · max_gain tokens to `num_requests` for `verify + n · per_draft` seconds more."""
    demand = 1 + MIN_GAIN
    margin = max_gain * costs.base - num_requests * demand * costs.per_draft
    return margin > 0 and num_positions * margin > num_requests * (demand * costs.verify + MIN_GAIN * costs.base)


def best_draft_counts(gains: Sequence[Sequence[float]], costs: StepCosts) -> list[int]:
    """Drafts per request maximising expected tokens per second of one step.

    `gains[r][j]` is the expected tokens request r's draft j + 1 adds (non-increasing
    in j); every request emits one token anyway. Every draft costs the same, so the
    best step takes the drafts of highest gain first: it is one of the prefixes of
    all drafts sorted by gain, each is scored and the best kept (the fewest drafts
    on a tie), provided it beats a step without drafts by `MIN_GAIN`. Ties at the cut
    go to the earlier requests."""
    # a row's gains never increase: one request's are ranked already (batch 1, the common case)
    ranked = list(gains[0]) if len(gains) == 1 else sorted((g for row in gains for g in row), reverse=True)
    tokens = float(len(gains))
    best_rate, best_n = tokens / costs.seconds(0) * (1 + MIN_GAIN), 0
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
