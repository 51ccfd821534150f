"""The scheduler-policy conformance checks can fail, and say why: the built-in
policies pass every ordering check, and each planted policy
(tests/planted/scheduler_policies.py) fails the check written for its guarantee
with a message that names the request, where it came out, and the guarantee."""

from __future__ import annotations

import pytest

from kvforge.conformance import check_scheduler_policy as check
from kvforge.conformance import check_scheduler_policy_queue as queue
from kvforge.plugins.scheduler_policies import FcfsPolicy, PriorityPolicy
from tests.planted.scheduler_policies import (
    AlwaysPreempts,
    LastComeFirstServed,
    PlaceFollowsProgress,
    PriorityWithoutTieBreak,
    RequeuesVictimAsNew,
    SparesTheLastRequest,
)


def run_ordering_checks(policy) -> None:
    for seed in check.SEEDS:
        check.test_waiting_order_is_total_and_breaks_ties_by_arrival(policy, seed)
        check.test_preempted_request_returns_to_its_original_place(policy, seed)
        check.test_victim_is_one_of_the_running_requests_for_every_list_length(policy, seed)
        check.test_never_preempts_a_request_that_would_run_first(policy, seed)


@pytest.mark.parametrize("cls", [FcfsPolicy, PriorityPolicy], ids=lambda c: c.name)
def test_the_built_in_policies_pass_every_ordering_check(cls):
    run_ordering_checks(cls())


def test_victim_lists_cover_one_and_two_requests_and_random_lengths():
    lengths = check.running_list_lengths(0)
    assert {0, 1, 2} <= set(lengths) and any(length > 3 for length in lengths)


def test_a_policy_that_spares_the_last_running_request_is_caught_naming_it_and_guarantee_3():
    with pytest.raises(AssertionError) as caught:
        check.test_victim_is_one_of_the_running_requests_for_every_list_length(SparesTheLastRequest(), 0)
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith("guarantee 3: choose_victim returned None for 1 running request(s) (r")
    assert "None is allowed only for an empty list" in first_line


def test_a_victim_that_is_not_among_the_running_is_caught():
    with pytest.raises(AssertionError, match=r"^guarantee 3: choose_victim returned RequestView\(request_id='r\d+'.*"
                                             r"not one of the \d+ running request"):
        check.test_victim_is_one_of_the_running_requests_for_every_list_length(RequeuesVictimAsNew(), 0)


@pytest.mark.parametrize("cls, pattern", [
    (LastComeFirstServed, r"^guarantee 1 \(ties break by arrival\): r\d+ \(priority \d, arrival \d+, prompt \d+ tokens\) "
                          r"arrived before r\d+ .*comes out at place \d+ of the waiting queue, after r\d+ at place \d+"),
    (PriorityWithoutTieBreak, r"^guarantee 1 \(a total order\): r\d+ \(priority .*\) and r\d+ \(.*\) both get "
                              r"waiting_key \(\d,\)"),
], ids=lambda v: getattr(v, "name", ""))
def test_a_broken_waiting_order_names_both_requests_their_places_and_guarantee_1(cls, pattern):
    with pytest.raises(AssertionError, match=pattern):
        check.test_waiting_order_is_total_and_breaks_ties_by_arrival(cls(), 0)


def test_a_key_that_follows_progress_names_the_request_and_its_new_place():
    with pytest.raises(AssertionError, match=r"^guarantee 2 \(a preempted request keeps its place\): r\d+ .* was at "
                                             r"place 20 of the waiting queue; .* comes out at place 39"):
        check.test_preempted_request_returns_to_its_original_place(PlaceFollowsProgress(), 0)


def test_preempting_a_request_that_runs_first_names_both_and_guarantee_4():
    with pytest.raises(AssertionError, match=r"^guarantee 4: may_preempt lets r\d+ .*\(place \d+ of the waiting "
                                             r"order\) preempt r\d+ .*\(place \d+\), which would run first"):
        check.test_never_preempts_a_request_that_would_run_first(AlwaysPreempts(), 0)


def test_equal_requests_out_of_arrival_order_in_the_queue_name_the_first_one_out_of_place():
    with pytest.raises(AssertionError, match=r"^guarantee 1 \(ties break by arrival\): requests of equal priority "
                                             r"started out of arrival order: r\d+ \(arrival \d+\) started at step"):
        queue.test_equal_requests_start_in_arrival_order(LastComeFirstServed(), 0)
