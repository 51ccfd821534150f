"""The shared conformance suite: checks per interface, the runner, the report.

A check group is a module `check_<group>.py` in this package that sets
`KIND = "<kind>"` and `GROUP = "<short name>"` and writes ordinary pytest tests
taking the `registration` fixture (a `kvforge.core.Registration`), which is
parametrized over every selected implementation of `KIND`. Adding a group is
writing that module; the runner finds it. Run with `kvforge conformance` or
`pytest --pyargs kvforge.conformance [--kvforge-plugin NAME ...]` (the pytest plugin
in `pytest_plugin.py`).
"""

from .runner import ConformanceRun, Failure, GroupResult, run_conformance

__all__ = ["ConformanceRun", "Failure", "GroupResult", "run_conformance"]
