"""Conformance of every `scheduler_policy`: the guarantees in
`kvforge.core.scheduler_policy.SchedulerPolicy`'s docstring, asked of the policy
directly. Every failure names the requests involved, where each came out, and
the numbered guarantee that placement breaks."""

import random

import pytest

from kvforge.core import RequestView, SCHEDULER_POLICY

from .selection import QuickGrid

KIND = SCHEDULER_POLICY
GROUP = "ordering"

SEEDS = QuickGrid(full=range(5), quick=range(2))
SHORT_LISTS = (0, 1, 2, 3)  # the lengths where "the last one" and "an empty list" are easy to get wrong


def make_requests(seed: int, count: int = 40) -> list[RequestView]:
    rng = random.Random(seed)
    return [
        RequestView(request_id=f"r{i}", priority=rng.randint(0, 3), arrival_time=float(i),
                    arrival_index=i, admitted_index=rng.choice([-1, *range(count)]),
                    num_prompt_tokens=rng.choice([8, 64]))
        for i in range(count)
    ]


def running_list_lengths(seed: int) -> list[int]:
    """Every short length, then a few random ones up to 16."""
    rng = random.Random(seed)
    return [*SHORT_LISTS, *(rng.randint(4, 16) for _ in range(3))]


def describe(request: RequestView) -> str:
    return (f"{request.request_id} (priority {request.priority}, arrival {request.arrival_index}, "
            f"prompt {request.num_prompt_tokens} tokens)")


def queue_order(policy, requests: list[RequestView]) -> list[str]:
    return [r.request_id for r in sorted(requests, key=policy.waiting_key)]


@pytest.fixture
def policy(registration):
    return registration.cls()


@pytest.mark.parametrize("seed", SEEDS)
def test_waiting_order_is_total_and_breaks_ties_by_arrival(policy, seed):
    requests = make_requests(seed)
    keys = {r.request_id: policy.waiting_key(r) for r in requests}
    holder: dict = {}
    for request in requests:
        other = holder.setdefault(keys[request.request_id], request)
        assert other is request, (
            f"guarantee 1 (a total order): {describe(other)} and {describe(request)} both get waiting_key "
            f"{keys[request.request_id]!r}, so which of them runs first depends on the queue's history")
    order = queue_order(policy, requests)
    for a in requests:
        for b in requests:
            same_submission = (a.priority, a.num_prompt_tokens) == (b.priority, b.num_prompt_tokens)
            if same_submission and a.arrival_index < b.arrival_index:
                assert keys[a.request_id] < keys[b.request_id], (
                    f"guarantee 1 (ties break by arrival): {describe(a)} arrived before {describe(b)}, submitted "
                    f"alike, but comes out at place {order.index(a.request_id)} of the waiting queue, after "
                    f"{b.request_id} at place {order.index(b.request_id)} (keys {keys[a.request_id]!r} and "
                    f"{keys[b.request_id]!r})")


@pytest.mark.parametrize("seed", SEEDS)
def test_preempted_request_returns_to_its_original_place(policy, seed):
    requests = make_requests(seed)
    order = queue_order(policy, requests)
    victim = next(r for r in requests if r.request_id == order[len(order) // 2])
    readmitted = RequestView(victim.request_id, victim.priority, victim.arrival_time, victim.arrival_index,
                             admitted_index=10_000, num_prompt_tokens=victim.num_prompt_tokens,
                             num_computed_tokens=0, num_output_tokens=7)
    rest = [r for r in requests if r.request_id != victim.request_id] + [readmitted]
    again = queue_order(policy, rest)
    before, after = order.index(victim.request_id), again.index(victim.request_id)
    assert again == order, (
        f"guarantee 2 (a preempted request keeps its place): {describe(victim)} was at place {before} of the "
        f"waiting queue; preempted after 7 output tokens and re-queued it comes out at place {after}, "
        f"{'behind ' + again[after - 1] if after else 'first'} (waiting_key {policy.waiting_key(victim)!r} became "
        f"{policy.waiting_key(readmitted)!r}): the key must depend only on what the request was submitted with")


@pytest.mark.parametrize("seed", SEEDS)
def test_victim_is_one_of_the_running_requests_for_every_list_length(policy, seed):
    rng = random.Random(seed)
    pool = make_requests(seed, count=16)
    for length in running_list_lengths(seed):
        running = rng.sample(pool, length)
        victim = policy.choose_victim(list(running))
        given = ", ".join(r.request_id for r in running) or "nothing"
        if not running:
            assert victim is None, (
                f"guarantee 3: choose_victim([]) returned {victim!r}; with no running request it must return None")
            continue
        assert victim is not None, (
            f"guarantee 3: choose_victim returned None for {length} running request(s) ({given}); None is allowed "
            f"only for an empty list: with blocks short the engine must preempt one of them")
        assert victim in running, (
            f"guarantee 3: choose_victim returned {victim!r}, which is not one of the {length} running request(s) "
            f"it was given ({given}); return one of those views unchanged")


@pytest.mark.parametrize("seed", SEEDS)
def test_never_preempts_a_request_that_would_run_first(policy, seed):
    requests = make_requests(seed, count=15)
    order = queue_order(policy, requests)
    for waiting in requests:
        for running in requests:
            if policy.waiting_key(running) < policy.waiting_key(waiting):
                assert not policy.may_preempt(waiting, running), (
                    f"guarantee 4: may_preempt lets {describe(waiting)} (place {order.index(waiting.request_id)} of "
                    f"the waiting order) preempt {describe(running)} (place {order.index(running.request_id)}), "
                    f"which would run first; the two could preempt each other forever")
