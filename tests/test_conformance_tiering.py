"""zeroio.testing.store's suites for every NVMe backend zeroio ships.

``MemoryBackend`` (host bytes, failure injection) and ``TensorStoreBackend`` (the zarr
TensorStore on a temporary directory) each run the store-vs-dict state machine and the
backend contract.
"""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, settings

from zeroio.testing.store import NvmeBackendTests, TieredStoreTests
from zeroio.tiering import MemoryBackend
from zeroio.tiering.nvme import TensorStoreBackend


class MemoryStoreVsDict(TieredStoreTests):
    def make_backend(self):
        return MemoryBackend()


class DiskStoreVsDict(TieredStoreTests):
    def make_backend(self):
        return TensorStoreBackend(tempfile.mkdtemp(prefix="zeroio-tiering-test-"))


MemoryStoreVsDict.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
DiskStoreVsDict.TestCase.settings = settings(
    max_examples=12, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_store_behaves_like_a_dict = MemoryStoreVsDict.TestCase
test_store_behaves_like_a_dict_on_disk = DiskStoreVsDict.TestCase


class TestMemoryBackend(NvmeBackendTests):
    def make_backend(self, tmp_path):
        return MemoryBackend()


class TestTensorStoreBackend(NvmeBackendTests):
    def make_backend(self, tmp_path):
        return TensorStoreBackend(tmp_path / "nvme")


def test_each_backend_runs_every_shipped_check():
    """The suites ship their checks (rules, invariants and tests live in zeroio.testing.store)
    and both backends above inherit all of them."""
    import unittest

    steps = ("register", "acquire_and_read", "acquire_for_overwrite", "write", "release",
             "prefetch", "step_boundary", "flush", "budgets_hold")
    for machine in (MemoryStoreVsDict, DiskStoreVsDict):
        assert all(getattr(machine, n) is getattr(TieredStoreTests, n) for n in steps), machine
        assert issubclass(machine.TestCase, unittest.TestCase)
    checks = {n for n in dir(NvmeBackendTests) if n.startswith("test_")}
    assert len(checks) >= 3
    for cls in (TestMemoryBackend, TestTensorStoreBackend):
        assert checks <= {n for n in dir(cls) if n.startswith("test_")}, cls
