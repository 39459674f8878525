"""The file access of checkpoints, exports and run folders: pools, atomic writes, fsync, probes.

The io layer owns every file that holds training state (DESIGN.md, "Ownership
rules"): the NVMe swap arrays go through ``IOEngine`` / ``TensorStore``, and
everything else the upper layers write — checkpoint pieces and metadata,
safetensors exports, run-folder records — goes through this module.

Whole-chunk reads (loading) go through the direct-I/O `IOEngine` into
4096-aligned buffers (`read_chunk`): chunk files are page multiples, so a load
reads the disk straight into the buffer the crc is checked on, bypassing the
page cache. Piece writes (saving) use `pwrite_all`, or with the checkpoint's
``direct`` option the same engine (O_DIRECT for each piece's aligned body).

`FileIO` has the shape of `IOEngine` (`write(path, tensor, offset)` /
`read(path, tensor, offset)` returning futures, `close()`): a small thread pool
over positional writes and reads (both release the GIL), which is what
checkpoint pieces need: their byte ranges are wherever rank boundaries fall,
not aligned to the 4 KiB that O_DIRECT wants. Its syscalls, and those of the
atomic writes, go through `OsOps`, the engine's fault-injection seam.

[Note: pool settings] How many threads the pools run and the request shape of
the engine come from `FileIOSettings`: 4 threads and the engine's defaults,
or, when the user's ``aio`` block differs from DeepSpeed's defaults (a block
written by ``zeroio tune io``), that block's ``thread_count`` threads and its
``block_size`` / ``queue_depth`` (`FileIOSettings.from_aio`).

[Note: atomic writes] `atomic_write_bytes` is the one atomic write: the bytes go
to ``.NAME.<12 hex>.tmp`` beside the target, are fsynced, renamed over the
target, and the folder is fsynced. Readers see the old file or the new one,
never half of one; a failed write removes its temp file and leaves the old one.

[Note: file modes] Every file and folder of a checkpoint or an export is
created with mode 0o666 / 0o777 less the process umask, as `open` and `mkdir`
do: a group-shared umask (0o007) makes a checkpoint the group can load, and
no file (manifest.json, latest, zarr.json included) is special. Private
files (swap state) pass ``mode=0o600``, set explicitly whatever the umask.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeroio import jsonlimits
from zeroio.errors import CheckpointError, SwapIOError
from zeroio.io.osops import OsOps
from zeroio.io.settings import EngineSettings

FILE_MODE = 0o666  # less the umask: see [Note: file modes]
DEFAULT_THREADS = 4
_OPS = OsOps()  # the syscalls of this module (a test patches OsOps to inject faults)


@dataclass(frozen=True, kw_only=True)
class FileIOSettings:
    """Threads of the checkpoint file pools and the engine's request shape ([Note: pool settings])."""

    threads: int = DEFAULT_THREADS
    """Concurrent piece writes (saving) or chunk reads (loading) per rank."""
    engine: EngineSettings | None = None
    """The direct-I/O engine's settings (chunk reads, direct piece writes); None: the engine's
    defaults with ``threads`` worker threads."""

    @classmethod
    def from_aio(cls, aio_cfg: object | None, threads: int = DEFAULT_THREADS) -> FileIOSettings:
        """``threads`` and the engine's defaults, unless ``aio_cfg`` (the config's ``aio`` block,
        a dict or an `EngineSettings`) differs from DeepSpeed's defaults: then its own."""
        aio = EngineSettings.resolve(aio_cfg) if aio_cfg is not None else EngineSettings()
        if aio == EngineSettings():
            return cls(threads=threads)
        return cls(threads=aio.thread_count, engine=aio)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def pwrite_all(path: str | os.PathLike, data: np.ndarray, offset: int) -> None:
    """Write every byte of ``data`` at ``offset`` of ``path`` (created if missing, never truncated)."""
    fd = _OPS.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                n = _OPS.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                raise SwapIOError(
                    e.errno or errno.EIO,
                    f"writing {len(view) - done} bytes at offset {offset + done} of {path} "
                    f"failed: {e.strerror}"
                ) from e
            done += n
    finally:
        _OPS.close(fd)


def pread_exact(path: str | os.PathLike, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` (uint8) from ``offset`` of ``path``; a short file is a CheckpointError."""
    try:
        fd = _OPS.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    try:
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = _OPS.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(
                    f"checkpoint file {path} is truncated: needed {len(view)} bytes at offset "
                    f"{offset}, the file ends after {offset + done}"
                )
            done += n
    finally:
        _OPS.close(fd)


class FileIO:
    """Concurrent positional reads and writes of tensor bytes; futures carry completion."""

    def __init__(self, threads: int = DEFAULT_THREADS):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="zeroio-ckpt")

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


def open_engine(settings: FileIOSettings | int):
    """The direct-I/O engine for checkpoint chunks ([Note: pool settings]); an int is a
    thread count with the engine's defaults."""
    from zeroio.io.engine import IOEngine

    if isinstance(settings, int):
        settings = FileIOSettings(threads=settings)
    if settings.engine is not None:
        return IOEngine(settings.engine)
    return IOEngine(thread_count=max(1, settings.threads))


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


def create_file(path: str | os.PathLike) -> None:
    """Create ``path`` empty if missing (mode: [Note: file modes]); an existing file is kept."""
    _OPS.close(_OPS.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))


def set_size(path: str | os.PathLike, nbytes: int) -> None:
    """Create ``path`` if needed and set its length (the zero-padded tail of a last chunk)."""
    fd = _OPS.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        _OPS.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    fd = _OPS.open(path, os.O_RDONLY)
    try:
        _OPS.fsync(fd)
    finally:
        _OPS.close(fd)


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move ``src`` to ``dst`` within one file system, atomically (a reader sees one or the
    other); ``fsync_dir`` the parent to make it durable."""
    os.rename(src, dst)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation in ``path`` durable (no-op where unsupported)."""
    try:
        fd = _OPS.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _OPS.fsync(fd)
    except OSError:
        pass
    finally:
        _OPS.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None,
                       durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically ([Note: atomic writes]).

    ``mode`` None: 0o666 less the umask ([Note: file modes]), not mkstemp's 0o600; else that
    mode exactly. ``durable=False`` skips the two fsyncs (scratch state that a crash discards
    anyway)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = _OPS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE if mode is None else mode)
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view, done = memoryview(data), 0
            while done < len(view):
                done += _OPS.write(fd, view[done:])
            if durable:
                _OPS.fsync(fd)
        finally:
            _OPS.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, SwapIOError):
            raise SwapIOError(e.errno or errno.EIO, f"writing {path} ({len(data)} bytes) failed: "
                              f"{e.strerror or e}; the previous {path.name} is unchanged") from e
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, **kw) -> None:
    """``atomic_write_bytes`` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), **kw)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1, **kw) -> None:
    """``obj`` as JSON (``indent``, then a newline) by ``atomic_write_bytes``."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n", **kw)


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse a JSON file within zeroio's limits ([Note: bounded JSON] in jsonlimits.py);
    missing, malformed, too large or too deep is a CheckpointError naming it."""
    try:
        jsonlimits.check_size(Path(path).stat().st_size, f"{what} {path}")
        return jsonlimits.loads(Path(path).read_text(encoding="utf-8"), f"{what} {path}")
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except jsonlimits.JSONLimitError as e:
        raise CheckpointError(f"{e}; the file is damaged or was not written by zeroio") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None


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


class PartialFile:
    """A file written front to back (with seeks) under ``.NAME.partial`` beside ``path``;
    `commit` renames it to ``path``, `abort` removes it, so an interrupted write never leaves
    a half-good file under the final name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit() / abort()

    def seek(self, pos: int) -> None:
        self._f.seek(pos)

    def write(self, data) -> None:
        self._f.write(data)

    def commit(self) -> None:
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Close and remove the partial file (idempotent)."""
        self._f.close()
        self.tmp.unlink(missing_ok=True)


# -- run-folder lock files and probes ---------------------------------------------------


def open_lock_file(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A read-write descriptor of ``path`` (created if missing) for ``flock`` and `rewrite_fd`."""
    return _OPS.open(path, os.O_RDWR | os.O_CREAT, mode)


def read_fd(fd: int) -> bytes:
    """Every byte of the open file ``fd``, from its start."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


def rewrite_fd(fd: int, data: bytes) -> None:
    """Make the open file ``fd`` hold exactly ``data``, durably (truncate, write, fsync)."""
    os.ftruncate(fd, 0)
    view, done = memoryview(data), 0
    while done < len(view):
        done += _OPS.pwrite(fd, view[done:], done)
    _OPS.fsync(fd)


def probe_o_direct(directory: str | os.PathLike) -> tuple[bool | None, str]:
    """Whether a file in ``directory`` opens with O_DIRECT (and why not); None where the
    platform has no O_DIRECT. The probe file is created and removed here."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None, "this platform has no O_DIRECT"
    name = Path(directory) / f".zeroio-report-{secrets.token_hex(6)}"
    _OPS.close(_OPS.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        _OPS.close(_OPS.open(name, os.O_RDWR | flag))
        return True, ""
    except OSError as e:
        return False, f"{e.strerror} (zeroio falls back to buffered I/O here)"
    finally:
        os.unlink(name)
