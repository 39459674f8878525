"""Waiting for space in the tiered store ([Note: waiting for space] in zeroio/tiering/mover.py).

A demand acquire that finds the tier held by *another* thread waits for its
release (a Condition), a release deferred on a sync object frees its space when
the object completes, a prefetch never fails for lack of space, and a
CapacityError comes only when waiting cannot help, naming budget and holders.
Every tensor is one 4 KiB page, so budgets are counted in tensors.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from zeroio.errors import CapacityError
from zeroio.tiering import MemoryBackend, Tier, TieredStore

PAGE = 4096
N = PAGE // 4  # float32 elements in one page


def _store(slots: int, **kw) -> TieredStore:
    store = TieredStore(None, backend=MemoryBackend(), policy="lru", prefetch_depth=0,
                        cpu_budget_bytes=slots * PAGE, nvme_budget_bytes=8 * PAGE, **kw)
    for i, name in enumerate("abcd"):
        store.register(name, (N,), torch.float32, home=Tier.NVME, init=torch.full((N,), float(i)))
    return store


class FakeEvent:
    """Stands in for a CUDA event: completes when ``fire`` is called."""

    def __init__(self):
        self._done = threading.Event()

    def fire(self):
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(10):
            raise TimeoutError("fake event never fired")


def test_demand_acquire_waits_for_another_threads_release():
    with _store(2) as s:
        held = threading.Event()
        go = threading.Event()

        def other():
            s.acquire("a", "cpu")
            s.acquire("b", "cpu")
            held.set()
            go.wait(10)
            time.sleep(0.3)
            s.release("a")
            s.release("b")

        t = threading.Thread(target=other, name="holder-thread")
        t.start()
        held.wait(10)
        go.set()
        t0 = time.perf_counter()
        got = s.acquire("c", "cpu")  # both pages are held by holder-thread: wait, not fail
        waited = time.perf_counter() - t0
        t.join()
        assert waited >= 0.25, waited
        assert torch.equal(got, torch.full((N,), 2.0))
        assert s.stats()["stall_seconds"] >= 0.25
        s.release("c")


def test_bounded_wait_names_budget_and_holders():
    with _store(2, acquire_timeout_s=0.3) as s:
        held, done = threading.Event(), threading.Event()

        def other():
            s.acquire("a", "cpu")
            s.acquire("b", "cpu")
            held.set()
            done.wait(10)
            s.release("a")
            s.release("b")

        t = threading.Thread(target=other, name="never-releases")
        t.start()
        held.wait(10)
        t0 = time.perf_counter()
        with pytest.raises(CapacityError) as ei:
            s.acquire("c", "cpu")
        assert 0.25 <= time.perf_counter() - t0 < 5
        msg = str(ei.value)
        assert "'c'" in msg and f"budget {2 * PAGE}" in msg and "never-releases" in msg
        assert "waited" in msg
        done.set()
        t.join()


def test_own_holds_fail_at_once():
    with _store(2) as s:
        s.acquire("a", "cpu")
        s.acquire("b", "cpu")
        t0 = time.perf_counter()
        with pytest.raises(CapacityError, match="calling thread itself holds"):
            s.acquire("c", "cpu")
        assert time.perf_counter() - t0 < 1.0  # no pointless wait for a release that cannot come
        assert "MainThread" in str(s._mover._holders(s._spaces[Tier.CPU]))


def test_deferred_release_frees_space_when_its_event_completes():
    with _store(1) as s:
        a = s.acquire("a", "cpu")
        assert torch.equal(a, torch.zeros(N))
        ev = FakeEvent()
        s.release("a", after=ev)  # an async copy still reads it
        assert s.residency("a")["cpu"] == "clean"
        assert s._spaces[Tier.CPU].cache["a"].pins == 1
        threading.Timer(0.2, ev.fire).start()
        t0 = time.perf_counter()
        got = s.acquire("b", "cpu")  # needs a's page: waits on the event, then evicts a
        assert ev.query() and time.perf_counter() - t0 >= 0.15
        assert torch.equal(got, torch.ones(N))
        assert "cpu" not in s.residency("a")
        s.release("b")
        done = FakeEvent()
        done.fire()
        s.acquire("b", "cpu")
        s.release("b", after=done)  # already complete: released at once
        assert s._spaces[Tier.CPU].cache["b"].pins == 0


def test_prefetch_never_fails_for_lack_of_space():
    with _store(1) as s:
        s.acquire("a", "cpu")
        s.prefetch(["b", "c", "d"], "cpu")  # no room: dropped, not an error
        s._prefetcher.join()
        assert all("cpu" not in s.residency(n) for n in "bcd")
        s.release("a")
        s.prefetch(["c"], "cpu")
        s._prefetcher.join()
        assert torch.equal(s.acquire("c", "cpu"), torch.full((N,), 2.0))
        s.release("c")
        assert s.stats()["hits"] >= 1
