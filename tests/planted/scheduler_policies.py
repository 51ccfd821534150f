"""Planted scheduler policies: `fcfs` and `priority` with one bug each, the bug in its docstring."""

from __future__ import annotations

import time
from dataclasses import replace

from kvforge.core import SchedulerPolicy


class ArrivalFirst(SchedulerPolicy):
    """A correct first-come-first-served policy, the base the mutants below break."""

    def waiting_key(self, request):
        return (request.arrival_index,)

    def choose_victim(self, running):
        return max(running, key=lambda r: r.arrival_index, default=None)


class LastComeFirstServed(ArrivalFirst):
    """Serves the newest arrival first: loses arrival order (guarantee 1)."""

    name = "last-come-first-served"

    def waiting_key(self, request):
        return (-request.arrival_index,)


class PriorityWithoutTieBreak(ArrivalFirst):
    """Orders by priority alone: equal priorities compare equal, and a stable sort keeps
    whatever order the queue happened to hold (guarantee 1)."""

    name = "priority-without-tie-break"

    def waiting_key(self, request):
        return (request.priority,)


class PlaceFollowsProgress(ArrivalFirst):
    """Keys on tokens generated so far: a preempted request returns behind requests
    that arrived after it (guarantee 2)."""

    name = "place-follows-progress"

    def waiting_key(self, request):
        return (request.num_output_tokens, request.arrival_index)


class RequeuesVictimAsNew(ArrivalFirst):
    """Returns the victim re-submitted as a new arrival, a duplicate of a running request
    that is not among those it was given: the original keeps running (guarantee 3)."""

    name = "requeues-victim-as-new"

    def choose_victim(self, running):
        victim = super().choose_victim(running)
        return None if victim is None else replace(victim, arrival_index=victim.arrival_index + len(running))


class SparesTheLastRequest(ArrivalFirst):
    """`choose_victim` returns None for a one-request list, as if the last running request
    could not be preempted: guarantee 3 allows None only for an empty list."""

    name = "spares-the-last-request"

    def choose_victim(self, running):
        return None if len(running) == 1 else super().choose_victim(running)


class AlwaysPreempts(ArrivalFirst):
    """`may_preempt` always says yes: two requests take each other's place forever
    (guarantee 4; the queue check's bounded loop ends the livelock)."""

    name = "always-preempts"

    def may_preempt(self, waiting, running):
        return True


class NeverReturns(ArrivalFirst):
    """`waiting_key` never returns: only the per-check time limit ends it."""

    name = "never-returns"
    hangs = True  # the one planted bug caught by the time limit rather than by a check

    def waiting_key(self, request):
        while True:
            time.sleep(1)  # waits without spinning: the proof must not eat a shared CPU


PLANTED = [LastComeFirstServed, PriorityWithoutTieBreak, PlaceFollowsProgress, RequeuesVictimAsNew,
           SparesTheLastRequest, AlwaysPreempts, NeverReturns]
