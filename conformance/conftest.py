"""Parametrizes the `registration` fixture of every check module over the selected
implementations of the module's KIND."""

from kvforge.conformance.selection import selected


def pytest_generate_tests(metafunc):
    if "registration" in metafunc.fixturenames:
        kind = getattr(metafunc.module, "KIND")
        registrations = selected(kind)
        metafunc.parametrize("registration", registrations, ids=[r.name for r in registrations])
