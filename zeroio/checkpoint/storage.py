"""The only module of the checkpoint layer that touches files.

Whole-chunk reads (loading) go through the io layer's direct-I/O `IOEngine`
into 4096-aligned buffers: chunk files are page multiples, so a load reads
the disk straight into the buffer the crc is checked on, bypassing the page
cache. Piece writes (saving) use `os.pwrite` (below), or with
`SaveOptions.direct` the same engine (O_DIRECT for each piece's aligned body).

`FileIO` has the shape of the io layer's `IOEngine` (`write(path, tensor,
offset)` / `read(path, tensor, offset)` returning futures, `close()`), so the
checkpoint code can switch to the direct-I/O engine by constructing that
instead. It is a small thread pool over `os.pwrite` / `os.preadv` (both
release the GIL), which is what checkpoint pieces need: their byte ranges are
wherever rank boundaries fall, not aligned to the 4 KiB that O_DIRECT wants.

[Note: file modes] Every file and folder of a checkpoint or an export is
created with mode 0o666 / 0o777 less the process umask, as `open` and `mkdir`
do: a group-shared umask (0o007) makes a checkpoint the group can load, and
no file (manifest.json, latest, zarr.json included) is special.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeroio.errors import CheckpointError, SwapIOError

FILE_MODE = 0o666  # less the umask: see [Note: file modes]


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def pwrite_all(path: str | os.PathLike, data: np.ndarray, offset: int) -> None:
    """Write every byte of ``data`` at ``offset`` of ``path`` (created if missing, never truncated)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                raise SwapIOError(
                    e.errno or errno.EIO,
                    f"writing {len(view) - done} bytes at offset {offset + done} of {path} "
                    f"failed: {e.strerror}"
                ) from e
            done += n
    finally:
        os.close(fd)


def pread_exact(path: str | os.PathLike, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` (uint8) from ``offset`` of ``path``; a short file is a CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    try:
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(
                    f"checkpoint file {path} is truncated: needed {len(view)} bytes at offset "
                    f"{offset}, the file ends after {offset + done}"
                )
            done += n
    finally:
        os.close(fd)


class FileIO:
    """Concurrent positional reads and writes of tensor bytes; futures carry completion."""

    def __init__(self, threads: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="zeroio-ckpt")

    def write(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int) -> Future:
        """Write a contiguous CPU tensor's bytes at byte ``offset`` of ``path``."""
        return self._pool.submit(pwrite_all, path, _as_bytes(tensor), offset)

    def read(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int) -> Future:
        """Fill a contiguous CPU tensor with the bytes at byte ``offset`` of ``path``."""
        return self._pool.submit(pread_exact, path, _as_bytes(tensor), offset)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> FileIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation in ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, rename it into place.

    The temp file is created like any other (mode 0o666 less the umask, [Note: file
    modes]), not with mkstemp's 0o600."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse a JSON file; missing or malformed is a CheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None


def set_size(path: str | os.PathLike, nbytes: int) -> None:
    """Create ``path`` if needed and set its length (the zero-padded tail of a last chunk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def open_engine(threads: int):
    """The io layer's direct-I/O engine, sized for checkpoint chunk reads."""
    from zeroio.io.engine import IOEngine

    return IOEngine(thread_count=max(1, threads))


def read_chunk(engine, path: str | os.PathLike, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``path`` as a uint8 tensor (aligned buffer, read by ``engine``).

    A missing or short file is a CheckpointError naming it (checked before reading,
    so the message says what the file is, not how the read failed).
    """
    from zeroio.io.buffers import AlignedBuffer

    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if size < nbytes:
        raise CheckpointError(
            f"checkpoint file {path} is truncated: needed {nbytes} bytes, the file has {size}"
        )
    buf = AlignedBuffer(nbytes, pin=False)
    try:
        engine.read(path, buf.tensor, 0).result()
    except SwapIOError as e:
        raise CheckpointError(f"reading checkpoint file {path} failed: {e}") from e
    return buf.tensor


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    system or the file system cannot (the caller falls back to two renames)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"exchanging {a} and {b} failed: {os.strerror(err)}")
