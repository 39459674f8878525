"""The direct-I/O engine: tensors to and from files at byte offsets, off the GIL.

[Note: request plan] A transfer of ``n`` bytes at file offset ``off`` is split
into pieces of ``queue_depth * block_size`` bytes (``block_size`` with
``single_submit``); each piece is one ``preadv``/``pwritev`` call carrying
``queue_depth`` iovecs, run on one of ``thread_count`` worker threads. The
syscalls release the GIL, so threads overlap each other and Python.

[Note: read and write lanes] Reads and writes run on separate pools of
``thread_count`` workers each, so a read never queues behind write-backs: a
swapped optimizer step reads the next pieces while it writes the previous ones
back, and with one FIFO of workers each read waited for the writes submitted
before it (a step near read + write time instead of the larger of the two
where the disk serves both at once). DeepSpeed's pipelined swapper keeps a
read and a write aio handle for the same reason. ``submit`` runs on the read
lane.

[Note: O_DIRECT] Files are opened with O_DIRECT where the filesystem allows
it. Direct requests need an aligned offset, length and address, so:
- the 4096-aligned body goes through the O_DIRECT descriptor;
- an unaligned tail (n % 4096 bytes) goes through a second, buffered
  descriptor (the kernel keeps the two coherent: direct I/O flushes and
  invalidates the page cache range it touches);
- a caller buffer at an unaligned address is bounced through a per-thread
  aligned staging buffer; an unaligned file offset uses the buffered path.
Where O_DIRECT is refused (EINVAL: tmpfs on older kernels, some FUSE/network
filesystems), the engine falls back to buffered I/O and warns once.

[Note: errors] Every OS failure becomes a ``SwapIOError`` naming the path,
the operation and the offset; ENOSPC/EDQUOT also name the bytes needed and
the bytes free. A read that returns fewer bytes than asked is an
``IntegrityError``: the future fails, so the caller never uses the data.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from zeroio.errors import IntegrityError, SwapIOError, ZeroIOError
from zeroio.io.buffers import ALIGN, AlignedBuffer
from zeroio.io.osops import OsOps
from zeroio.io.settings import EngineSettings

O_DIRECT = getattr(os, "O_DIRECT", 0)
_MODES = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "rw": os.O_RDWR | os.O_CREAT}
_MAX_SYSCALL_BYTES = 1 << 30  # Linux caps one transfer near 2 GiB; stay well under.


class IOArgumentError(ZeroIOError, ValueError):
    """A tensor or offset handed to the engine cannot be transferred as given."""


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view over a contiguous CPU tensor's memory (no copy)."""
    if t.device.type != "cpu":
        raise IOArgumentError(f"IOEngine: tensor must be on the CPU (pinned or not), got {t.device}")
    if not t.is_contiguous():
        raise IOArgumentError("IOEngine: tensor must be contiguous; call .contiguous() first")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def no_space_error(ops: OsOps, path: str, needed: int, err: OSError | None = None) -> SwapIOError:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        free = ops.disk_free(directory)
    except OSError:
        free = -1
    return SwapIOError(
        errno.ENOSPC,
        f"no space left for {path}: needs {needed} bytes, {free} bytes free on "
        f"{directory}; free space or point nvme_path at a larger disk",
    )


def os_error(ops: OsOps, e: OSError, path: str, op: str, offset: int, nbytes: int) -> SwapIOError:
    if isinstance(e, SwapIOError):
        return e
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space_error(ops, path, nbytes, e)
    if e.errno == errno.ENOENT:
        msg = f"{op} {path}: file or directory does not exist (create the directory first)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        msg = f"{op} {path}: not writable/readable by this process ({e.strerror})"
    else:
        msg = f"{op} {path} failed at offset {offset} ({nbytes} bytes): {e.strerror or e}"
    return SwapIOError(e.errno or errno.EIO, msg)


class _Gather:
    """Completes ``future`` with ``result`` once ``n`` parts are done, or with the first error."""

    def __init__(self, future: Future, n: int, result: object, on_done: Callable[[], None]):
        self.future, self.left, self.result, self.on_done = future, n, result, on_done
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def part_done(self, part: Future) -> None:
        err = part.exception()
        with self.lock:
            if err is not None and self.error is None:
                self.error = err
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                self.on_done()
            finally:
                if self.error is not None:
                    self.future.set_exception(self.error)
                else:
                    self.future.set_result(self.result)


@dataclass
class _Files:
    """The descriptors of one transfer: O_DIRECT (may be None) and buffered (lazy)."""

    path: str
    flags: int
    direct: int | None
    buffered: int | None = None
    lock: threading.Lock = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.lock = threading.Lock()


class IOEngine:
    """Reads and writes tensors at file offsets; see the notes at the top of the module."""

    def __init__(
        self,
        aio_cfg: object | None = None,
        *,
        block_size: int | None = None,
        queue_depth: int | None = None,
        thread_count: int | None = None,
        intra_op_parallelism: int | None = None,
        single_submit: bool | None = None,
        overlap_events: bool | None = None,
        use_gds: bool | None = None,
        direct: bool | None = None,
        os_ops: OsOps | None = None,
    ):
        self.settings = EngineSettings.resolve(
            aio_cfg,
            block_size=block_size,
            queue_depth=queue_depth,
            thread_count=thread_count if thread_count is not None else intra_op_parallelism,
            single_submit=single_submit,
            overlap_events=overlap_events,
            use_gds=use_gds,
            direct=direct,
        )
        s = self.settings
        self.ops = os_ops or OsOps()
        self.piece_bytes = s.block_size * (1 if s.single_submit else s.queue_depth)
        # [Note: read and write lanes]
        self._pool = ThreadPoolExecutor(max_workers=s.thread_count, thread_name_prefix="zeroio-io")
        self._write_pool = ThreadPoolExecutor(max_workers=s.thread_count,
                                              thread_name_prefix="zeroio-io-write")
        self._local = threading.local()
        self._warned_fallback = False
        self._warn_lock = threading.Lock()
        self._closed = False
        if s.use_gds:
            warnings.warn(
                "aio.use_gds: GPUDirect Storage is not available in zeroio's I/O engine; "
                "using the host (pinned buffer) path",
                stacklevel=2,
            )

    # -- public API ------------------------------------------------------------

    def read(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``tensor`` with ``tensor.nbytes`` bytes of ``path`` from byte ``offset``.

        The future's result is ``tensor``; on error it raises and the contents
        of ``tensor`` are undefined.
        """
        return self._transfer(os.fspath(path), tensor, int(offset), writing=False)

    def write(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Write ``tensor``'s bytes to ``path`` at byte ``offset`` (creating the file).

        The future's result is the number of bytes written. ``tensor`` must not
        change until the future is done.
        """
        return self._transfer(os.fspath(path), tensor, int(offset), writing=True)

    async def aread(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return await asyncio.wrap_future(self.read(path, tensor, offset))

    async def awrite(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> int:
        return await asyncio.wrap_future(self.write(path, tensor, offset))

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on an engine worker (for callers doing their own syscalls)."""
        self._check_open()
        return self._pool.submit(fn, *args)

    def preallocate(self, path: str | os.PathLike, nbytes: int) -> None:
        """Reserve ``nbytes`` for ``path`` now, so a full disk fails here, not mid-training."""
        path = os.fspath(path)
        try:
            fd = self.ops.open(path, os.O_WRONLY | os.O_CREAT)
        except OSError as e:
            raise os_error(self.ops, e, path, "preallocate", 0, nbytes) from e
        try:
            have = os.fstat(fd).st_blocks * 512
            needed = max(0, nbytes - have)
            directory = os.path.dirname(os.path.abspath(path))
            if needed > self.ops.disk_free(directory):
                raise no_space_error(self.ops, path, needed)
            if nbytes > 0:
                self.ops.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise os_error(self.ops, e, path, "preallocate", 0, nbytes) from e
        finally:
            self.ops.close(fd)

    def drop_cache(self, path: str | os.PathLike) -> None:
        """Evict ``path`` from the page cache (benchmarks of the buffered path)."""
        fd = self.ops.open(os.fspath(path), os.O_RDONLY)
        try:
            self.ops.fadvise_dontneed(fd)
        finally:
            self.ops.close(fd)

    @property
    def direct_enabled(self) -> bool:
        return self.settings.direct is not False and O_DIRECT != 0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._write_pool.shutdown(wait=True)

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- synchronous building blocks (run in the calling thread) ---------------

    def pread_into(self, files: _Files, mem: np.ndarray, offset: int) -> None:
        """Read ``len(mem)`` bytes at ``offset`` into ``mem``, body direct, tail buffered."""
        self._run_range(files, mem, offset, writing=False)

    def pwrite_from(self, files: _Files, mem: np.ndarray, offset: int) -> None:
        self._run_range(files, mem, offset, writing=True)

    def open_files(self, path: str, mode: str) -> _Files:
        """Open ``path`` ("r", "w" or "rw"; O_DIRECT where possible); close with ``close_files``."""
        flags = _MODES[mode]
        direct = None
        if self.direct_enabled:
            try:
                direct = self.ops.open(path, flags | O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise os_error(self.ops, e, path, "open", 0, 0) from e
                self._warn_fallback(path)
        files = _Files(path, flags, direct)
        if direct is None:
            self._buffered_fd(files)
        return files

    def close_files(self, files: _Files) -> None:
        for fd in (files.direct, files.buffered):
            if fd is not None:
                try:
                    self.ops.close(fd)
                except OSError:
                    pass

    # -- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SwapIOError(errno.EBADF, "IOEngine is closed")

    def _warn_fallback(self, path: str) -> None:
        with self._warn_lock:
            if self._warned_fallback:
                return
            self._warned_fallback = True
        warnings.warn(
            f"O_DIRECT is not supported for {path} (e.g. tmpfs); zeroio falls back to "
            "buffered I/O, which goes through the page cache",
            RuntimeWarning,
            stacklevel=3,
        )

    def _buffered_fd(self, files: _Files) -> int:
        with files.lock:
            if files.buffered is None:
                try:
                    files.buffered = self.ops.open(files.path, files.flags)
                except OSError as e:
                    raise os_error(self.ops, e, files.path, "open", 0, 0) from e
            return files.buffered

    def _transfer(self, path: str, tensor: torch.Tensor, offset: int, writing: bool) -> Future:
        self._check_open()
        if offset < 0:
            raise IOArgumentError(f"IOEngine: offset must be >= 0, got {offset} for {path}")
        mem = tensor_bytes(tensor)
        result: object = mem.nbytes if writing else tensor
        out: Future = Future()
        out.set_running_or_notify_cancel()
        if mem.nbytes == 0:
            if writing:  # still create the file, as a zero-byte write would
                self.close_files(self.open_files(path, "w"))
            out.set_result(result)
            return out
        files = self.open_files(path, "w" if writing else "r")
        pieces = [(start, min(start + self.piece_bytes, mem.nbytes))
                  for start in range(0, mem.nbytes, self.piece_bytes)]
        gather = _Gather(out, len(pieces), result, lambda: self.close_files(files))
        for start, end in pieces:
            pool = self._write_pool if writing else self._pool
            part = pool.submit(self._run_range, files, mem[start:end], offset + start, writing)
            part.add_done_callback(gather.part_done)
        return out

    def _run_range(self, files: _Files, mem: np.ndarray, offset: int, writing: bool) -> None:
        n = mem.nbytes
        try:
            if files.direct is not None and offset % ALIGN == 0:
                body = n - n % ALIGN
                if body:
                    done = self._direct_range(files, mem[:body], offset, writing)
                    if done is False:  # direct refused at I/O time: whole range buffered
                        body = 0
                if body < n:
                    self._plain_range(self._buffered_fd(files), files.path, mem[body:], offset + body, writing)
            else:
                self._plain_range(self._buffered_fd(files), files.path, mem, offset, writing)
        except OSError as e:
            raise os_error(self.ops, e, files.path, "write" if writing else "read", offset, n) from e

    def _direct_range(self, files: _Files, mem: np.ndarray, offset: int, writing: bool) -> bool:
        """The aligned body through O_DIRECT; False if the filesystem refused it."""
        aligned_mem = mem.ctypes.data % ALIGN == 0
        step = min(self.piece_bytes, _MAX_SYSCALL_BYTES)
        try:
            for start in range(0, mem.nbytes, step):
                part = mem[start : start + step]
                if aligned_mem:
                    self._plain_range(files.direct, files.path, part, offset + start, writing)
                else:
                    stage = self._staging(part.nbytes)
                    if writing:
                        stage[: part.nbytes] = part
                        self._plain_range(files.direct, files.path, stage[: part.nbytes], offset + start, writing)
                    else:
                        self._plain_range(files.direct, files.path, stage[: part.nbytes], offset + start, writing)
                        part[...] = stage[: part.nbytes]
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # A direct read that hit end of file returns a partial, unaligned
            # count, and the next request is then refused: that is a short
            # read, not a filesystem without O_DIRECT.
            size = os.fstat(files.direct).st_size
            if not writing and size < offset + mem.nbytes:
                raise IntegrityError(
                    errno.EIO,
                    f"short read of {files.path}: wanted {mem.nbytes} bytes at offset {offset}, "
                    f"file is {size} bytes",
                ) from e
            self._warn_fallback(files.path)
            return False
        return True

    def _plain_range(self, fd: int, path: str, mem: np.ndarray, offset: int, writing: bool) -> None:
        """Loop ``preadv``/``pwritev`` over ``mem`` in iovecs of block_size until done."""
        bs = self.settings.block_size
        per_call = 1 if self.settings.single_submit else self.settings.queue_depth
        pos, n = 0, mem.nbytes
        while pos < n:
            iov = []
            p = pos
            while p < n and len(iov) < per_call and p - pos < _MAX_SYSCALL_BYTES:
                iov.append(mem[p : p + bs])
                p += bs
            if writing:
                got = self.ops.pwritev(fd, iov, offset + pos)
            else:
                got = self.ops.preadv(fd, iov, offset + pos)
                if got == 0:
                    raise IntegrityError(
                        errno.EIO,
                        f"short read of {path}: wanted {n} bytes at offset {offset}, "
                        f"file ends after {pos} of them",
                    )
            pos += got

    def _staging(self, nbytes: int) -> np.ndarray:
        buf: AlignedBuffer | None = getattr(self._local, "stage", None)
        if buf is None or buf.capacity < nbytes:
            buf = AlignedBuffer(max(nbytes, self.piece_bytes), pin=False)
            self._local.stage = buf
        return buf.full.numpy()
