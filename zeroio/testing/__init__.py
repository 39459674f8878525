"""Helpers shared by zeroio's tests: the multi-rank harness and conformance suites."""

from zeroio.testing.multirank import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
