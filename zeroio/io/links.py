"""Sharing a swap file's bytes with a checkpoint: reflink, hard link, or (reported) copy.

A checkpoint of NVMe-resident optimizer state need not read and rewrite it:
the swap store's chunk files already hold the bytes, each followed by its
crc32c ([Note: chunk files] in layout.py). ``share_file`` gives the checkpoint
its own name for one such file, by the cheapest means the file systems allow:

- ``reflink`` (``FICLONE``: btrfs, XFS, bcachefs): a new inode whose extents are
  shared copy-on-write by the file system. Either file may be rewritten or
  removed without touching the other.
- ``hardlink`` (``os.link``: any POSIX file system): a second name of the same
  inode. Removing either name leaves the other intact, but a write in place
  changes both: the swap store must never write in place over a shared chunk
  file ([Note: shared chunk files] in store.py).
- ``copy`` (``os.copy_file_range``, in the kernel): when neither is possible
  (another file system: ``EXDEV``; links not permitted), with the reason.

The source is held under a shared ``flock`` while it is shared, so a store
write (which holds an exclusive lock on the chunk file for its whole update)
is never half-way through when the link is made, and the crc read from the
file's tail is the one of the data beside it. The new name is fsynced (the
swap store does not fsync: its state is discarded by a crash, a checkpoint's
is not).
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass

from zeroio.errors import IntegrityError, SwapIOError
from zeroio.io.files import FILE_MODE
from zeroio.io.layout import CRC_BYTES

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
MODES = ("reflink", "hardlink", "copy")

# errors that mean "this way of sharing is not available here", not "the disk failed"
_UNSUPPORTED = {errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL,
                errno.ENOSYS, errno.EMLINK, errno.EACCES, errno.EBADF}


@dataclass(frozen=True, kw_only=True)
class Shared:
    """How one file was shared."""

    mode: str
    """"reflink", "hardlink" or "copy"."""
    nbytes: int
    """Size of the file (data, padding and crc)."""
    crc32c: int
    """The crc32c stored at ``crc_at`` (of the bytes before it)."""
    reason: str = ""
    """Why the cheaper modes were not used (empty for the first mode tried)."""


def _reflink(src_fd: int, dst: str) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        fcntl.ioctl(fd, FICLONE, src_fd)
    except OSError:
        os.close(fd)
        os.unlink(dst)
        raise
    os.close(fd)


def _hardlink(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def _copy(src_fd: int, dst: str, nbytes: int) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        done = 0
        while done < nbytes:
            n = os.copy_file_range(src_fd, fd, nbytes - done, done, done)
            if n <= 0:
                raise SwapIOError(errno.EIO, f"copying to {dst}: the source ended at byte {done} "
                                  f"of {nbytes}")
            done += n
    except BaseException:
        os.close(fd)
        os.unlink(dst)
        raise
    os.close(fd)


def _open_current(src: str) -> tuple[int, os.stat_result]:
    """``src`` opened and share-locked, and still the inode its name points at (a store write
    that breaks a link renames a new file over the name while holding the old one's lock)."""
    for _ in range(8):
        fd = os.open(src, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if os.stat(src).st_ino == st.st_ino:
                return fd, st
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise SwapIOError(errno.EBUSY, f"{src} kept being replaced while it was shared; retry the save")


def share_file(src: str | os.PathLike, dst: str | os.PathLike, *, nbytes: int, crc_at: int,
               modes: tuple[str, ...] = MODES) -> Shared:
    """Give ``src`` (``nbytes`` long, its crc32c at byte ``crc_at``) the new name ``dst`` by the
    first of ``modes`` that works; returns how. A source of another size is an
    ``IntegrityError``; a disk failure a ``SwapIOError``. ``dst`` must not exist."""
    src, dst = os.fspath(src), os.fspath(dst)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"share_file: modes {modes!r}; each must be one of {MODES}")
    try:
        fd, st = _open_current(src)
    except FileNotFoundError:
        raise IntegrityError(errno.ENOENT, f"swap file {src} is missing; it cannot be shared") from None
    reasons: list[str] = []
    try:
        if st.st_size != nbytes:
            raise IntegrityError(errno.EIO, f"swap file {src} is {st.st_size} bytes, expected {nbytes}")
        tail = os.pread(fd, CRC_BYTES, crc_at)
        if len(tail) != CRC_BYTES:
            raise IntegrityError(errno.EIO, f"swap file {src}: no crc at byte {crc_at}")
        crc = int.from_bytes(tail, "little")
        for mode in modes:
            try:
                if mode == "reflink":
                    _reflink(fd, dst)
                elif mode == "hardlink":
                    _hardlink(src, dst)
                    if os.stat(dst).st_ino != st.st_ino:  # the name moved under us: not ours
                        os.unlink(dst)
                        raise SwapIOError(errno.EBUSY, f"{src} was replaced while it was linked")
                else:
                    _copy(fd, dst, nbytes)
            except OSError as e:
                if e.errno not in _UNSUPPORTED or mode == "copy":
                    raise SwapIOError(e.errno or errno.EIO,
                                      f"sharing {src} as {dst} ({mode}): {e.strerror or e}") from e
                reasons.append(f"{mode}: {e.strerror or errno.errorcode.get(e.errno, e.errno)}")
                continue
            _fsync(dst)
            return Shared(mode=mode, nbytes=nbytes, crc32c=crc, reason="; ".join(reasons))
        raise SwapIOError(errno.EOPNOTSUPP, f"sharing {src} as {dst}: {'; '.join(reasons)}")
    finally:
        os.close(fd)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_device(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two existing paths are on one file system (where a hard link can be made)."""
    return os.stat(a).st_dev == os.stat(b).st_dev


__all__ = ["MODES", "Shared", "same_device", "share_file"]
