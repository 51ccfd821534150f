"""Which data-parallel replica serves a request.

A request's load is its outstanding tokens: prompt tokens not yet prefilled
plus new tokens not yet generated (`n * max_tokens` at first). `least_tokens`
sends each request to the live replica with the fewest outstanding tokens (ties:
fewer requests, then the lower index). `prefix` sends requests whose prompts
open with the same first block of tokens (and carry the same `cache_salt`) to
the replica that served that block before, so its prefix cache hits, unless that
replica is much busier than the least-loaded one (more than twice its
outstanding tokens plus one full context), when it falls back to least-loaded.

Pure bookkeeping, no processes or I/O, so it is tested alone with fakes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROUTING_POLICIES = ("least_tokens", "prefix")
MAX_REMEMBERED_PREFIXES = 4096  # affinities kept, least recently used dropped first


class NoReplicaError(RuntimeError):
    """Every replica has died: nothing can serve a request."""


class Router:
    """Outstanding tokens per replica and per request, and the routing choice."""

    def __init__(self, num_replicas: int, policy: str = "least_tokens", *, prefix_tokens: int = 16,
                 imbalance_slack_tokens: int = 0):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown data-parallel routing {policy!r}; choose one of {', '.join(ROUTING_POLICIES)}")
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.policy = policy
        self.prefix_tokens = prefix_tokens
        self.imbalance_slack_tokens = imbalance_slack_tokens
        self.load = [0] * num_replicas  # outstanding tokens
        self.num_requests = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.dead_reason: dict[int, str] = {}
        self._requests: dict[str, tuple[int, int]] = {}  # request id: (replica, its outstanding tokens)
        self._affinity: OrderedDict[tuple, int] = OrderedDict()

    # The choice

    def choose(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The replica for a prompt (it is not recorded until `add`)."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            reasons = "; ".join(f"replica {i}: {why}" for i, why in sorted(self.dead_reason.items()))
            raise NoReplicaError(f"every data-parallel replica has died ({reasons})")
        least = min(live, key=lambda i: (self.load[i], self.num_requests[i], i))
        key = self._prefix_key(token_ids, cache_salt)
        if key is None:
            return least
        known = self._affinity.get(key)
        if known is not None and self.alive[known] and not self._much_busier(known, least):
            self._affinity.move_to_end(key)
            return known
        self._affinity[key] = least
        self._affinity.move_to_end(key)
        while len(self._affinity) > MAX_REMEMBERED_PREFIXES:
            self._affinity.popitem(last=False)
        return least

    def _prefix_key(self, token_ids: Sequence[int], cache_salt: str | None) -> tuple | None:
        if self.policy != "prefix" or len(token_ids) < self.prefix_tokens:
            return None  # shorter than a block: nothing the prefix cache could share
        return (cache_salt, tuple(token_ids[:self.prefix_tokens]))

    def _much_busier(self, replica: int, least: int) -> bool:
        return self.load[replica] > 2 * self.load[least] + self.imbalance_slack_tokens

    # Accounting

    def add(self, request_id: str, replica: int, tokens: int) -> None:
        """`request_id` went to `replica` with `tokens` outstanding."""
        self._requests[request_id] = (replica, tokens)
        self.load[replica] += tokens
        self.num_requests[replica] += 1

    def update(self, request_id: str, tokens: int) -> None:
        """`request_id` now has `tokens` outstanding (it prefilled or generated)."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        replica, before = entry
        self.load[replica] += tokens - before
        self._requests[request_id] = (replica, tokens)

    def release(self, request_id: str) -> None:
        """`request_id` finished, failed or was aborted: it loads nothing any more."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, tokens = entry
        self.load[replica] -= tokens
        self.num_requests[replica] -= 1

    def replica_of(self, request_id: str) -> int | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def requests_on(self, replica: int) -> list[str]:
        return [rid for rid, (r, _) in self._requests.items() if r == replica]

    def mark_dead(self, replica: int, reason: str) -> list[str]:
        """No request goes to `replica` again; returns (and releases) the ones it held."""
        self.alive[replica] = False
        self.dead_reason[replica] = reason
        lost = self.requests_on(replica)
        for request_id in lost:
            self.release(request_id)
        return lost


def outstanding_tokens(prompt_tokens: int, max_tokens: int, samples: Sequence[tuple[int, bool]]) -> int:
    """Prompt tokens not yet prefilled plus new tokens not yet generated, given
    each sample's (tokens generated, finished). The prompt counts as prefilled
    once any sample has a token; a finished sample owes nothing."""
    prefill = prompt_tokens if not any(generated for generated, _ in samples) else 0
    return prefill + sum(0 if done else max(max_tokens - generated, 0) for generated, done in samples)
