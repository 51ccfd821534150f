"""The `scheduler_policy` interface: the pluggable part of scheduling.

The engine owns the mechanism (token budget, chunked prefill, continuous
batching); a policy decides only three things: the order of the waiting queue,
which running request to preempt when blocks run out, and whether a waiting
request may take a running one's place.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .api import SCHEDULER_POLICY
from .implementation import Implementation


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about a request.

    `arrival_index` is unique and increases with arrival; `admitted_index` is
    unique and increases each time the request is (re)admitted to running, or -1
    while it has never run.
    """

    request_id: str
    priority: int
    arrival_time: float
    arrival_index: int
    admitted_index: int = -1
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_output_tokens: int = 0


class SchedulerPolicy(Implementation):
    """Guarantees every implementation keeps (the conformance suite checks each):

      1. `waiting_key` is a total order: two distinct requests never compare
         equal, and among otherwise equal requests the earlier arrival goes first.
      2. A preempted request returning to the waiting queue keeps its original
         place, because the key depends only on what the request was submitted with.
      3. `choose_victim` returns one of the given running requests, or None when
         the list is empty.
      4. `may_preempt(waiting, running)` is False whenever `running` would come
         before `waiting` in the waiting order.
    """

    kind: ClassVar[str] = SCHEDULER_POLICY

    @abstractmethod
    def waiting_key(self, request: RequestView) -> tuple[Any, ...]:
        """Sort key of the waiting queue; smaller runs first."""

    @abstractmethod
    def choose_victim(self, running: Sequence[RequestView]) -> RequestView | None:
        """The running request to preempt when blocks run out."""

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        """Whether `waiting` may preempt `running` to get room. Default: never."""
        return False
