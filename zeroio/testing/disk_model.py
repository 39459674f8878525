"""A ``MemoryBackend`` that stands in for a disk in tests: one transfer at a time at a fixed
bandwidth (sleeps; unlimited by default), logging every read and write as it is issued."""

from __future__ import annotations

import threading
import time

import torch

from zeroio.tiering import MemoryBackend


class DiskModel(MemoryBackend):
    """One transfer at a time at ``bandwidth`` bytes/s; ``log`` holds (op, name, bytes) in
    issue order."""

    def __init__(self, bandwidth: float = float("inf")):
        super().__init__(threads=4)
        self.bandwidth = bandwidth
        self.log: list[tuple[str, str, int]] = []
        self._disk = threading.Lock()
        self._log_lock = threading.Lock()

    def _record(self, op: str, name: str, t: torch.Tensor) -> None:
        with self._log_lock:
            self.log.append((op, name, t.numel() * t.element_size()))

    def _busy(self, nbytes: int) -> None:
        if self.bandwidth != float("inf"):
            with self._disk:
                time.sleep(nbytes / self.bandwidth)

    def write(self, name, tensor):
        self._record("write", name, tensor)
        return self._pool.submit(lambda: (self._busy(tensor.numel() * 4), self._write(name, tensor))[1])

    def read_into(self, name, out):
        self._record("read", name, out)
        return self._pool.submit(lambda: (self._busy(out.numel() * 4), self._read(name, out))[1])

    def count(self, op: str, name: str | None = None) -> int:
        return sum(b for o, n, b in self.log if o == op and (name is None or n == name))
