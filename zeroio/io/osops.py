"""The OS calls the I/O engine and the file pools of ``zeroio.io.files`` make, behind one
object so tests can inject faults.

Production code uses ``OsOps()``; a test subclasses it and overrides, say,
``pwritev`` to raise ``OSError(ENOSPC)`` or ``preadv`` to return short (or patches
``OsOps.pwrite`` to fail every checkpoint piece write).
"""

from __future__ import annotations

import os
import shutil


class OsOps:
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def pwrite(self, fd: int, data, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def write(self, fd: int, data) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def fadvise_dontneed(self, fd: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def disk_free(self, path: str) -> int:
        return shutil.disk_usage(path).free
