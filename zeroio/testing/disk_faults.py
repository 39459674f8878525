"""A failing disk under an engine's NVMe optimizer state, for tests of what a step does when
its swap I/O fails.

``DiskFaults(engine)`` wraps the swap backend of ``engine.optimizer.store``: reads of chosen
arrays fail with EIO, and while ``full`` every write fails with ENOSPC, as a real disk would
report them, until ``clear``. ``fail_reads`` first lets the I/O in flight land and drops the
host copies of the arrays it fails: a copy the store still holds (write-behind in flight, or
brought in by the store's own prefetch) would be a hit with no disk read to fail, and whether
there is one depends on the machine's speed.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future

from zeroio.errors import SwapIOError
from zeroio.tiering import Tier


def _failed(err: OSError) -> Future:
    f: Future = Future()
    f.set_exception(err)
    return f


class DiskFaults:
    def __init__(self, engine):
        self.store = engine.optimizer.store
        self.backend = self.store._backend
        self._read, self._write = self.backend.read_into, self.backend.write
        self.bad_reads: set[str] = set()
        self.full = False
        self.backend.read_into = self.read_into
        self.backend.write = self.write

    def fail_reads(self, names: set[str]) -> None:
        """From now on reading ``names`` from disk fails; none of them stays in host memory."""
        self.store.drain()
        self.bad_reads |= set(names)
        for name in names:  # clean copies: dropped at once (a later prefetch reads and fails)
            self.store.evict(name, Tier.CPU)

    def read_into(self, name, out):
        if name in self.bad_reads:
            return _failed(OSError(errno.EIO, f"injected read error of {name}"))
        return self._read(name, out)

    def write(self, name, tensor):
        if self.full:
            return _failed(SwapIOError(errno.ENOSPC,
                                       f"No space left on device (injected, writing {name})"))
        return self._write(name, tensor)

    def clear(self) -> None:
        """The disk is well again."""
        self.bad_reads.clear()
        self.full = False
