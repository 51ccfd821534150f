"""Checks that do not apply to an implementation, told apart from checks skipped for a reason.

A static-scale check of a dynamic quantizer, a prefix-caching check of an allocator
that does not declare it, a `priority` promise asked of `fcfs`: nothing is missing,
the check simply has nothing to ask. Such a check calls `not_applicable(why)`; the
runner counts it apart from a skip (an unavailable backend, a target a proposer
refuses), and a group of such checks alone is reported as "n/a", never as skipped,
so an implementation that passes everything that applies to it is a full pass.
"""

from __future__ import annotations

import pytest

NOT_APPLICABLE = "not applicable"


def not_applicable(why: str) -> None:
    """Skip the running check as one that does not apply, saying why."""
    pytest.skip(f"{NOT_APPLICABLE}: {why}")


def is_not_applicable(skip_reason: str) -> bool:
    return skip_reason.startswith(f"{NOT_APPLICABLE}: ")
