"""zeroio.testing's I/O suites for the engine and tensor-store configurations zeroio uses.

The engine runs buffered (``direct=False``), with O_DIRECT where the file system takes it
(the default), and with one-block requests (``single_submit``); the tensor store runs over
a small-block engine and over a buffered one.
"""

from __future__ import annotations

from zeroio.io import IOEngine, TensorStore
from zeroio.testing.io_engine import IOEngineTests
from zeroio.testing.tensor_store import TensorStoreTests


class TestDefaultEngine(IOEngineTests):
    def make_engine(self):
        return IOEngine(block_size=64 * 1024, queue_depth=4, thread_count=3)


class TestBufferedEngine(IOEngineTests):
    def make_engine(self):
        return IOEngine(block_size=64 * 1024, queue_depth=4, thread_count=2, direct=False)


class TestSingleSubmitEngine(IOEngineTests):
    def make_engine(self):
        return IOEngine(block_size=4096, queue_depth=2, thread_count=2, single_submit=True)


class TestStoreOnSmallBlocks(TensorStoreTests):
    def make_store(self, root):
        return TensorStore(root, IOEngine(block_size=65536, queue_depth=4, thread_count=2))


class TestStoreBuffered(TensorStoreTests):
    def make_store(self, root):
        return TensorStore(root, IOEngine(direct=False, thread_count=2))


def test_each_configuration_runs_every_shipped_check():
    """The suites ship their checks (the assertions live in zeroio.testing) and every
    configuration above inherits all of them."""
    for suite, configs in ((IOEngineTests, (TestDefaultEngine, TestBufferedEngine,
                                            TestSingleSubmitEngine)),
                           (TensorStoreTests, (TestStoreOnSmallBlocks, TestStoreBuffered))):
        checks = {n for n in dir(suite) if n.startswith("test_")}
        assert len(checks) >= 3, suite
        for cls in configs:
            assert checks <= {n for n in dir(cls) if n.startswith("test_")}, cls
