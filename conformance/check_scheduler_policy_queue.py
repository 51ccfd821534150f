"""Conformance of every `scheduler_policy` inside a running queue.

A tiny model of the engine's mechanism drives the policy: `slots` requests run
at once, each needs `service` steps, arrivals join the waiting queue, and a
waiting request may preempt a running one only when the policy allows it (the
victim is the policy's choice, and it is re-queued under its original key).
The checks assert the docstring guarantees in that setting, plus the promises
of the built-in `fcfs` (no starvation) and `priority` (a high-priority request
submitted into a full engine starts first, preempting when it must).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from kvforge.core import RequestView, SCHEDULER_POLICY

from .applicability import not_applicable
from .selection import QuickGrid

KIND = SCHEDULER_POLICY
GROUP = "queueing"

SEEDS = QuickGrid(full=range(3), quick=range(1))


@dataclass
class Outcome:
    started: dict[str, int]  # first step each request ran
    finished: dict[str, int]
    preempted: list[str]


def simulate(policy, arrivals: dict[int, list[RequestView]], slots: int, service: int, steps: int = 10_000) -> Outcome:
    """Run the queue; `arrivals[step]` join before that step is scheduled."""
    waiting: list[RequestView] = []
    running: dict[str, list] = {}  # id -> [view, steps left]
    admitted = iter(range(10**9))
    out = Outcome({}, {}, [])
    pending = sum(len(v) for v in arrivals.values())
    for step in range(steps):
        waiting += arrivals.get(step, [])
        waiting.sort(key=policy.waiting_key)
        # Guarantee 4 lets a preemption only put a request that sorts earlier in place of
        # a later one, so a step admits each request at most once per slot; more is a
        # livelock (two requests preempting each other), which would never end this loop.
        admissions, bound = 0, (len(waiting) + len(running)) * (slots + 1)
        while waiting:
            head = waiting[0]
            admissions += 1
            assert admissions <= bound, (
                f"step {step}: {admissions} admissions in one step with {slots} slots, so the policy livelocks "
                f"(last: {head.request_id} in place of {out.preempted[-1] if out.preempted else 'nothing'}); "
                "guarantee 4: may_preempt(waiting, running) is False whenever running would come before waiting")
            if len(running) >= slots:
                candidates = [v for v, _ in running.values() if policy.may_preempt(head, v)]
                victim = policy.choose_victim(candidates)
                if victim is None:
                    break
                assert victim in candidates, "choose_victim returned a request it was not given"
                del running[victim.request_id]
                out.preempted.append(victim.request_id)
                waiting.append(replace(victim, num_computed_tokens=0))
                waiting.sort(key=policy.waiting_key)
                head = waiting[0]
            waiting.remove(head)
            view = replace(head, admitted_index=next(admitted))
            running[view.request_id] = [view, service]
            out.started.setdefault(view.request_id, step)
        for request_id in list(running):
            running[request_id][1] -= 1
            if running[request_id][1] == 0:
                del running[request_id]
                out.finished[request_id] = step
        if len(out.finished) == pending:
            break
    return out


def view(i: int, priority: int = 0) -> RequestView:
    return RequestView(request_id=f"r{i}", priority=priority, arrival_time=float(i), arrival_index=i)


@pytest.fixture
def policy(registration):
    return registration.cls()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_request_finishes_and_victims_come_from_the_running(policy, seed):
    rng = random.Random(seed)
    arrivals: dict[int, list[RequestView]] = {}
    for i in range(60):
        arrivals.setdefault(rng.randrange(40), []).append(view(i, rng.randint(0, 3)))
    out = simulate(policy, arrivals, slots=3, service=4)
    unfinished = sorted(set(f"r{i}" for i in range(60)) - set(out.finished), key=lambda r: int(r[1:]))
    assert not unfinished, (
        f"{len(unfinished)} of 60 requests never finished ({', '.join(unfinished[:5])}): preemption by "
        f"may_preempt/choose_victim kept them from running to the end (guarantees 3 and 4)")


@pytest.mark.parametrize("seed", SEEDS)
def test_equal_requests_start_in_arrival_order(policy, seed):
    rng = random.Random(seed)
    arrivals: dict[int, list[RequestView]] = {}
    step = 0
    for i in range(30):
        step += rng.choice([0, 0, 1, 2])
        arrivals.setdefault(step, []).append(view(i))
    out = simulate(policy, arrivals, slots=2, service=3)
    order = sorted(out.started, key=lambda r: (out.started[r], int(r[1:])))
    late = next((i for i, request_id in enumerate(order) if request_id != f"r{i}"), None)
    assert late is None, (
        f"guarantee 1 (ties break by arrival): requests of equal priority started out of arrival order: "
        f"{order[late]} (arrival {order[late][1:]}) started at step {out.started[order[late]]}, ahead of r{late} "
        f"(arrival {late}), which started at step {out.started.get(f'r{late}', 'never')}")
    assert out.preempted == [], (
        f"guarantee 4: equal requests preempted each other ({', '.join(out.preempted[:5])} preempted); a request "
        f"may only preempt one that sorts after it")


def test_fcfs_never_starves_a_request_under_a_steady_stream(policy, registration):
    if registration.name != "fcfs":
        not_applicable("no-starvation is the promise of fcfs")
    # A new request of higher priority arrives every step, forever; r0 must still start promptly.
    arrivals = {0: [view(0, priority=9)]} | {s: [view(s, priority=0)] for s in range(1, 400)}
    arrivals[0].insert(0, view(1000, priority=0))
    out = simulate(policy, arrivals, slots=1, service=2)
    assert out.started["r0"] <= 2 and len(out.finished) == 401


def test_priority_request_into_a_full_engine_starts_first_and_preempts(policy, registration):
    if registration.name != "priority":
        not_applicable("preemption on submission is the promise of priority")
    arrivals = {0: [view(i, priority=5) for i in range(4)], 1: [view(10, priority=0)]}
    out = simulate(policy, arrivals, slots=2, service=5)
    assert out.started["r10"] == 1  # at once, though both slots were busy
    assert out.preempted == ["r1"]  # the lowest-priority, latest-arrived running request
    assert all(out.started["r10"] < out.started[f"r{i}"] for i in (2, 3))
