"""Built-in scheduler policies: `fcfs` and `priority`."""

from __future__ import annotations

from collections.abc import Sequence

from kvforge.core import RequestView, SchedulerPolicy, hookimpl


class FcfsPolicy(SchedulerPolicy):
    """First come, first served. The most recently admitted running request is the
    preemption victim, so the oldest work keeps making progress (no starvation)."""

    name = "fcfs"
    priority = 10  # the default under `auto`

    def waiting_key(self, request: RequestView) -> tuple:
        return (request.arrival_index,)

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView | None:
        return max(running, key=lambda r: (r.admitted_index, r.arrival_index), default=None)


class PriorityPolicy(SchedulerPolicy):
    """Lower `priority` value first; earlier arrival breaks ties. The victim is the
    lowest-priority (highest value), latest-arrived running request. A waiting
    request of strictly higher priority may preempt lower-priority running ones."""

    name = "priority"

    def waiting_key(self, request: RequestView) -> tuple:
        return (request.priority, request.arrival_index)

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView | None:
        return max(running, key=lambda r: (r.priority, r.arrival_index), default=None)

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        return waiting.priority < running.priority


@hookimpl
def kvforge_implementations():
    return [FcfsPolicy, PriorityPolicy]
