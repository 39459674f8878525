"""The prefetch queue behind ``TieredStore.prefetch``: one thread that starts background loads.

Names queued (by ``prefetch``, or by the policy's prediction after an acquire or a release)
are loaded into their tier by a daemon thread. It issues each load (which runs on the I/O
engine's threads and the copy stream) and goes on to the next without waiting for it. A
load that finds no room is dropped (a hint); any other failure is kept on the entry and
surfaces at its next acquire.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from zeroio.errors import CapacityError, ZeroIOError
from zeroio.tiering.mover import Mover
from zeroio.tiering.state import Entry
from zeroio.tiering.tier import Tier


class Prefetcher:
    """The store's prefetch thread and queue; ``lock`` is the store's bookkeeping lock."""

    def __init__(self, lock: threading.Condition, entries: dict[str, Entry], mover: Mover,
                 closed: Callable[[], bool]):
        self._lock = lock
        self._entries = entries
        self._mover = mover
        self._closed = closed
        self._queue: queue.Queue = queue.Queue()
        self._queued: set[tuple[str, Tier]] = set()
        self._worker: threading.Thread | None = None

    def enqueue(self, names: list[str], tier: Tier) -> None:
        """Queue the names not already queued or in ``tier`` (lock held)."""
        for name in names:
            if (name, tier) in self._queued or tier in self._entries[name].copies:
                continue
            self._queued.add((name, tier))
            self._queue.put((name, tier))
        if self._worker is None and self._queued:
            self._worker = threading.Thread(target=self._serve, name="zeroio-tiering-prefetch", daemon=True)
            self._worker.start()

    def join(self) -> None:
        """Wait until every queued name has been taken and its load issued (lock not held)."""
        self._queue.join()

    def shutdown(self) -> None:
        """Stop the thread, after the store is marked closed (lock not held)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()

    def _serve(self) -> None:
        """The prefetch queue: issues loads (which run on the I/O engine's threads and
        the copy stream) and goes on to the next without waiting for them."""
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, tier = item
                with self._lock:
                    self._queued.discard(item)
                    entry = self._entries.get(name)
                    if self._closed() or entry is None:
                        continue
                    try:
                        self._mover.load(entry, tier, prefetch=True)
                    except CapacityError:
                        pass  # a hint that does not fit is dropped
                    except ZeroIOError as exc:
                        entry.error = entry.error or exc  # surfaces at the next acquire
            finally:
                self._queue.task_done()
