"""A load that fails and is settled by another thread before its asynchronous acquirer lands.

[Note: a load that failed before it was waited for] in zeroio/tiering/store.py. The order
of events is forced (reads answered by hand, the landing thread kept busy), so the race that
showed as ``AttributeError: 'NoneType' object has no attribute 'tensor'`` in some stage-3 runs
with a failing swap file is reproduced every time. Reference: the backend's injected error,
which the acquirer must receive as a ``SwapIOError`` naming the tensor.
"""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from zeroio.errors import SwapIOError
from zeroio.testing.store import PAGE
from zeroio.tiering import MemoryBackend, Tier, TieredStore


class HandAnsweredReads(MemoryBackend):
    """Reads of the names in ``held`` return a future the test completes."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, Future] = {}
        self.asked = threading.Event()

    def read_into(self, name, out):
        if name in self.held:
            self.asked.set()
            return self.held[name]
        return super().read_into(name, out)


def _wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def test_failed_load_settled_before_the_landing_thread_looks_raises_swap_io_error():
    backend = HandAnsweredReads()
    with TieredStore(None, backend=backend, prefetch_depth=0, cpu_budget_bytes=8 * PAGE,
                     nvme_budget_bytes=8 * PAGE) as s:
        for n in ("a", "b"):
            s.register(n, (8,), torch.float32, home=Tier.NVME, init=torch.arange(8.0))
        a_read, b_read = Future(), Future()
        backend.held = {"a": a_read, "b": b_read}
        # 1. a prefetch starts loading "a": its CPU copy is LOADING
        s.prefetch(["a"], "cpu")
        _wait_until(lambda: s.residency("a").get("cpu") == "loading", "a's load")
        # 2. an acquire of "b" occupies the landing thread (its read is not answered yet)
        fb = s.acquire_async("b", "cpu")
        _wait_until(lambda: s.residency("b").get("cpu") == "loading", "b's load")
        # 3. an acquire of "a" is a hit on the LOADING copy; its landing waits behind b's
        fa = s.acquire_async("a", "cpu")
        # 4. a's read fails, and this thread settles it (a stats poll): the copy is dropped
        a_read.set_exception(OSError(errno.EIO, "injected read error"))
        _wait_until(lambda: (s.stats(), "cpu" not in s.residency("a"))[1], "a dropped")
        # 5. b lands, then a's landing runs on a copy that is gone
        b_read.set_result(None)
        fb.result(timeout=10)
        s.release("b", "cpu")
        with pytest.raises(SwapIOError, match="'a'.*injected read error"):
            fa.result(timeout=10)
        # the store is usable: a fresh acquire reads "a" again
        backend.held = {}
        torch.testing.assert_close(s.acquire("a", "cpu"), torch.arange(8.0))
        s.release("a", "cpu")
