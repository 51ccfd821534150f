"""The data-parallel router alone: least outstanding tokens, prefix affinity with
its fallback, dead replicas, and the outstanding-token count itself. Fast: no
processes, no model."""

from __future__ import annotations

import pytest

from kvforge.serving.router import NoReplicaError, Router, outstanding_tokens

BLOCK = 4


def check_least_tokens(router: Router) -> None:
    assert router.choose([1] * 10) == 0  # a tie goes to the lower index
    router.add("a", 0, 100)
    assert router.choose([1] * 10) == 1
    router.add("b", 1, 30)
    assert router.choose([1] * 10) == 1  # 30 < 100: tokens count, not requests
    router.add("c", 1, 30)
    router.add("d", 1, 50)
    assert router.load == [100, 110]
    assert router.choose([1] * 10) == 0


def test_each_request_goes_to_the_replica_with_the_fewest_outstanding_tokens():
    check_least_tokens(Router(2))


class _FewestRequests(Router):
    """A plausible wrong router: counts requests, not tokens."""

    def choose(self, token_ids, cache_salt=None):
        return min(range(len(self.load)), key=lambda i: (self.num_requests[i], i))


def test_the_least_tokens_check_catches_a_router_that_counts_requests():
    with pytest.raises(AssertionError):
        check_least_tokens(_FewestRequests(2))


def test_progress_and_finishing_lower_a_replicas_load():
    router = Router(2)
    router.add("a", 0, 100)
    router.add("b", 1, 60)
    router.update("a", 40)  # a prefilled and generated: 40 left
    assert router.load == [40, 60] and router.choose([1]) == 0
    router.release("b")
    assert router.load == [40, 0] and router.choose([1]) == 1
    router.release("b")  # twice is harmless
    router.update("gone", 5)  # so is an unknown request
    assert router.load == [40, 0] and router.num_requests == [1, 0]


def test_outstanding_tokens_count_prefill_until_the_first_token_then_what_is_left_to_generate():
    assert outstanding_tokens(10, 8, [(0, False)]) == 18
    assert outstanding_tokens(10, 8, [(0, False), (0, False)]) == 26  # n=2 share the prompt
    assert outstanding_tokens(10, 8, [(3, False)]) == 5
    assert outstanding_tokens(10, 8, [(3, False), (8, True)]) == 5
    assert outstanding_tokens(10, 8, [(2, True)]) == 0  # stopped early: owes nothing


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica():
    router = Router(2, "prefix", prefix_tokens=BLOCK, imbalance_slack_tokens=100)
    system = [5, 6, 7, 8]
    first = router.choose(system + [1, 2])
    router.add("a", first, 20)
    # least_tokens would now pick the other replica; the prefix keeps it where its cache is
    assert router.choose(system + [9, 9, 9]) == first
    router.add("b", first, 20)
    other = router.choose([1, 1, 1, 1, 2])
    assert other != first  # a new prefix goes to the least-loaded replica
    # a different cache salt never shares cached blocks, so it is a different prefix
    router.add("c", other, 1000)
    assert router.choose(system + [3], cache_salt="tenant-b") == first  # least-loaded (40 < 1000)
    # prompts shorter than a block have nothing to share: least-loaded
    assert router.choose([5, 6, 7]) == first


def test_least_tokens_routing_ignores_prefixes():
    router = Router(2, "least_tokens", prefix_tokens=BLOCK)
    router.add("a", router.choose([5, 6, 7, 8, 1]), 20)
    assert router.choose([5, 6, 7, 8, 2]) == 1


def test_prefix_routing_falls_back_to_least_loaded_when_its_replica_is_much_busier():
    router = Router(2, "prefix", prefix_tokens=BLOCK, imbalance_slack_tokens=10)
    prompt = [5, 6, 7, 8, 1]
    assert router.choose(prompt) == 0
    router.add("a", 0, 30)
    router.add("b", 1, 10)
    assert router.choose(prompt) == 0  # 30 <= 2 * 10 + 10: not much busier
    router.add("c", 0, 1)
    assert router.choose(prompt) == 1  # 31 > 30: falls back ...
    assert router.choose(prompt) == 1  # ... and the prefix now lives there


def test_a_dead_replica_gets_nothing_and_hands_back_its_requests():
    router = Router(2, "prefix", prefix_tokens=BLOCK)
    prompt = [5, 6, 7, 8, 1]
    router.add("a", router.choose(prompt), 10)
    router.add("b", 1, 500)
    assert router.mark_dead(0, "was killed by signal 9") == ["a"]
    assert router.load[0] == 0 and router.replica_of("a") is None
    assert router.choose(prompt) == 1  # its prefix affinity does not outlive it
    router.mark_dead(1, "exited with status 1")
    with pytest.raises(NoReplicaError, match="replica 0: was killed by signal 9; replica 1: exited with status 1"):
        router.choose(prompt)


def test_bad_settings_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="least_tokens, prefix"):
        Router(2, "round_robin")
    with pytest.raises(ValueError, match="at least one replica"):
        Router(0)
