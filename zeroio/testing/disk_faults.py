"""A failing disk under an engine's NVMe optimizer state, for tests of what a step does when
its swap I/O fails.

``DiskFaults(engine)`` wraps the swap backend of ``engine.optimizer.store``: reads of chosen
arrays fail with EIO, and while ``full`` every write fails with ENOSPC, as a real disk would
report them, until ``clear``. ``enospc_once(name)`` fails one write lower down, in the I/O
engine's ``pwritev`` of one of ``name``'s swap files, so the error travels the real path (the
I/O layer's message names the file and the errno). ``fail_reads`` first lets the I/O in flight land and drops the
host copies of the arrays it fails: a copy the store still holds (write-behind in flight, or
brought in by the store's own prefetch) would be a hit with no disk read to fail, and whether
there is one depends on the machine's speed.
"""

from __future__ import annotations

import errno
import os
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
        self._restore_ops = lambda: None
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

    def damage(self, names: set[str], how: str = "delete") -> list[str]:
        """Damage the swap files of ``names`` on disk: ``"delete"`` removes each chunk file
        (a user's ``rm``), ``"corrupt"`` replaces it by a copy with its first byte flipped
        (the crc no longer matches; a new file, so a checkpoint that shares the old one by a
        hard link keeps its bytes, as it would from any writer that replaces the file). First
        every copy in host memory is written back and dropped, so the next use of each reads
        the disk. Returns the damaged files' paths."""
        if how not in ("delete", "corrupt"):
            raise ValueError(f"damage: how is 'delete' or 'corrupt', got {how!r}")
        self.store.flush()
        for name in names:
            self.store.evict(name, Tier.CPU)  # clean after the flush: dropped at once
        self.store.drain()
        paths = sorted({path for name in names for path, *_ in self.backend.files_of(name)})
        for path in paths:
            if how == "corrupt":
                with open(path, "rb") as fh:
                    data = bytearray(fh.read())
                data[0] ^= 0xFF
                with open(path + ".damaged", "wb") as fh:
                    fh.write(data)
                os.replace(path + ".damaged", path)
            else:
                os.remove(path)
        return paths

    def enospc_once(self, name: str) -> list[str]:
        """The next OS write into ``name``'s swap files fails with ENOSPC (once); returns
        the folders of those files. Needs the engine's real NVMe backend (files on disk)."""
        paths = {path for path, *_ in self.backend.files_of(name) or []}
        if not paths:
            raise ValueError(f"{name!r} has no swap files to fail a write of")
        # a chunk file a checkpoint shares is replaced by a new file beside it: same folder
        folders = tuple({os.path.dirname(p) + os.sep for p in paths})
        ops = self.backend._engine.ops
        pwritev, failed = ops.pwritev, []

        def pwritev_once(fd, buffers, offset):
            if not failed and os.readlink(f"/proc/self/fd/{fd}").startswith(folders):
                failed.append(fd)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return pwritev(fd, buffers, offset)

        ops.pwritev = pwritev_once
        self._restore_ops = lambda: setattr(ops, "pwritev", pwritev)
        return sorted(folders)

    def clear(self) -> None:
        """The disk is well again."""
        self.bad_reads.clear()
        self.full = False
        restore, self._restore_ops = self._restore_ops, lambda: None
        restore()
