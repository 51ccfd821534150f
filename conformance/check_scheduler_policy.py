"""Conformance of every `scheduler_policy`: the guarantees in
`kvforge.core.scheduler_policy.SchedulerPolicy`'s docstring."""

import random

import pytest

from kvforge.core import RequestView, SCHEDULER_POLICY

KIND = SCHEDULER_POLICY
GROUP = "ordering"


def make_requests(seed: int, count: int = 40) -> list[RequestView]:
    rng = random.Random(seed)
    return [
        RequestView(request_id=f"r{i}", priority=rng.randint(0, 3), arrival_time=float(i),
                    arrival_index=i, admitted_index=rng.choice([-1, *range(count)]),
                    num_prompt_tokens=rng.choice([8, 64]))
        for i in range(count)
    ]


@pytest.fixture
def policy(registration):
    return registration.cls()


@pytest.mark.parametrize("seed", range(5))
def test_waiting_order_is_total_and_breaks_ties_by_arrival(policy, seed):
    requests = make_requests(seed)
    keys = [policy.waiting_key(r) for r in requests]
    assert len(set(keys)) == len(keys), "two distinct requests compare equal"
    for a in requests:
        for b in requests:
            same_submission = (a.priority, a.num_prompt_tokens) == (b.priority, b.num_prompt_tokens)
            if same_submission and a.arrival_index < b.arrival_index:
                assert policy.waiting_key(a) < policy.waiting_key(b)


@pytest.mark.parametrize("seed", range(5))
def test_preempted_request_returns_to_its_original_place(policy, seed):
    requests = make_requests(seed)
    order = sorted(requests, key=policy.waiting_key)
    victim = order[len(order) // 2]
    readmitted = RequestView(victim.request_id, victim.priority, victim.arrival_time, victim.arrival_index,
                             admitted_index=10_000, num_prompt_tokens=victim.num_prompt_tokens,
                             num_computed_tokens=0, num_output_tokens=7)
    rest = [r for r in requests if r.request_id != victim.request_id] + [readmitted]
    assert [r.request_id for r in sorted(rest, key=policy.waiting_key)] == [r.request_id for r in order]


@pytest.mark.parametrize("seed", range(5))
def test_victim_is_one_of_the_running_requests(policy, seed):
    running = make_requests(seed, count=10)
    assert policy.choose_victim(running) in running
    assert policy.choose_victim([]) is None


@pytest.mark.parametrize("seed", range(5))
def test_never_preempts_a_request_that_would_run_first(policy, seed):
    requests = make_requests(seed, count=15)
    for waiting in requests:
        for running in requests:
            if policy.waiting_key(running) < policy.waiting_key(waiting):
                assert not policy.may_preempt(waiting, running)
