"""Test-session settings shared by every test file."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def monarch_failures_do_not_end_the_test_session():
    """Some tests run Monarch in the pytest process and kill its procs on purpose. Monarch's
    default hook for a failure nobody handled exits the process, and its supervision can report
    a killed proc after that test has finished, which would stop the whole session with a stray
    KeyboardInterrupt. Recording such late reports keeps them from ending unrelated tests; each
    test still sees the failures of its own calls as exceptions."""
    import monarch.actor

    late: list = []
    saved = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = late.append
    yield late
    monarch.actor.unhandled_fault_hook = saved
