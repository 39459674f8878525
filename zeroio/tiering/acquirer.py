"""The threads behind ``TieredStore.acquire_async``: one starts loads, one lands them.

[Note: asynchronous acquire]
Only the bookkeeping that fixes the access order (the policy's touch, hit or miss,
the pin of a copy already there) runs in the caller. The rest runs on two threads,
in call order:

- the *start* thread makes room (which may wait for a victim's write-back to land,
  or for another acquire's release) and starts the load: a caller that asks for the
  next tensor before computing on the current one must not wait there for the
  write-back of the previous one;
- the *landing* thread waits for each started load to land and resolves its future.

Keeping the two apart is what gives the disk depth: the start thread issues the next
load while the previous ones are still being read, so a consumer that reads several
tensors ahead (the NVMe step's read-ahead) has that many reads on the I/O engine's
read lane at once, not one. Loads started and not yet landed are bounded
(``in_flight``): each holds a host or device buffer, and the bound keeps a burst of
requests from taking every buffer the budget allows before the first is used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from zeroio.tiering.stats import TierStats

IN_FLIGHT = 8
"""Loads started and not landed, at most: the NVMe step's read-ahead (three pieces of
two moments) plus the two it computes on."""


class TimedFuture(Future):
    """The future of ``acquire_async``: blocking in ``result`` counts as stall."""

    def __init__(self, stats: TierStats):
        super().__init__()
        self._stats = stats

    def result(self, timeout: float | None = None):
        if self.done():
            return super().result(timeout)
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._stats.stalled(time.perf_counter() - t0)


class Acquirer:
    """Start and landing threads for asynchronous acquires (created on first use)."""

    def __init__(self, stats: TierStats, in_flight: int = IN_FLIGHT):
        self._stats = stats
        self._slots = threading.BoundedSemaphore(max(1, in_flight))
        self._start: ThreadPoolExecutor | None = None
        self._land: ThreadPoolExecutor | None = None
        self._guard = threading.Lock()

    def submit(self, start: Callable[[], Any], land: Callable[[Any], Any]) -> Future:
        """``start()`` on the start thread, then ``land(start's result)`` on the landing
        thread; the future holds ``land``'s result or the first error."""
        with self._guard:
            if self._start is None:
                self._start = ThreadPoolExecutor(1, thread_name_prefix="zeroio-tiering-acquire")
                self._land = ThreadPoolExecutor(1, thread_name_prefix="zeroio-tiering-landing")
            starter, lander = self._start, self._land
        future = TimedFuture(self._stats)

        def landed(token: Any) -> None:
            try:
                future.set_result(land(token))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self._slots.release()

        def started() -> None:
            if not future.set_running_or_notify_cancel():
                return
            self._slots.acquire()
            try:
                token = start()
            except BaseException as exc:
                self._slots.release()
                future.set_exception(exc)
                return
            lander.submit(landed, token)  # type: ignore[union-attr]

        starter.submit(started)
        return future

    def shutdown(self) -> None:
        """Finish what was submitted, then stop both threads (start first: it feeds landing)."""
        with self._guard:
            starter, lander = self._start, self._land
        if starter is not None:
            starter.shutdown(wait=True)
        if lander is not None:
            lander.shutdown(wait=True)
