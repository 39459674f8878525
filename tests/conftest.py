"""Session set-up shared by every test module."""

from zeroio.testing.multirank import start_forkserver


def pytest_sessionstart(session):
    # the rank server snapshots the environment now, before any test changes it
    start_forkserver()
