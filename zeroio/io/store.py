"""TensorStore: flat 1-D tensors in a zarr v3 group, read and written through the IOEngine.

Layout: see [Note: chunk files] in ``zeroio.io.layout``.

[Note: concurrent range writes] Any process may write any element range of
an array at any time; writes to disjoint ranges never lose each other's
bytes and every chunk's crc always matches its data. The rule that makes
this true: the chunk is the unit of locking and checksumming. A writer
takes an exclusive ``flock`` on each chunk file it touches, for the whole
update of that chunk (data, then crc). A chunk the write covers entirely is
written without reading; a chunk it covers partly is read, verified,
merged and rewritten under the same lock (read-modify-write). Readers take
a shared lock per chunk, so they never see a chunk between its data and its
crc. ``flock`` works between processes and between threads (each operation
opens its own file description). Writers that align their ranges to chunk
boundaries (``chunk_elems`` chosen at ``create``) never pay the
read-modify-write. Metadata (``zarr.json``) is written atomically (temp
file, rename), and ``create`` is idempotent for identical arguments, so N
ranks may all call it.

[Note: integrity] A chunk file whose size is not ``chunk_bytes + 4`` is
truncated; a chunk whose crc32c does not match is corrupt. Either fails the
future with ``IntegrityError`` naming the array, the chunk and the file;
partial chunks are verified in a staging buffer before any byte reaches
the caller, whole chunks land in the caller's buffer and the future fails,
so the data is never used. Preallocated chunk files start as valid zero
chunks (fallocate + crc of zeros), so ENOSPC is raised at ``create``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from concurrent.futures import Future

import numpy as np
import torch

from zeroio.errors import IntegrityError, SwapIOError
from zeroio.io.buffers import AlignedBuffer
from zeroio.io.crc import crc32c, zeros_crc
from zeroio.io.engine import (
    IOArgumentError,
    IOEngine,
    _Files,
    _Gather,
    no_space_error,
    tensor_bytes,
)
from zeroio.io.files import atomic_write_text
from zeroio.io.layout import (
    CRC_BYTES,
    ArrayInfo,
    array_metadata,
    check_name,
    default_chunk_elems,
    dtype_name,
    group_metadata,
    metadata_json,
    parse_array,
    read_metadata,
)


class ArrayNotFoundError(SwapIOError, FileNotFoundError):
    """No array of that name in the store."""


class ArrayExistsError(SwapIOError, FileExistsError):
    """``create`` found an array of that name with a different shape, dtype or chunking."""


class TensorStore:
    """A zarr v3 group of flat 1-D arrays; see the notes at the top of the module."""

    def __init__(self, root: str | os.PathLike, engine: IOEngine | None = None, *,
                 private: bool = False):
        """``private``: every folder the store makes is 0700 and every file 0600, set
        explicitly whatever the umask (swap state: [Note: swap folders] in swapdir.py)."""
        self.root = os.path.abspath(os.fspath(root))
        self.private = private
        try:
            self._makedirs(self.root)
        except OSError as e:
            raise SwapIOError(e.errno or errno.EIO, f"TensorStore: cannot create {self.root}: {e.strerror}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise SwapIOError(errno.EACCES, f"TensorStore: {self.root} is not writable by this process")
        self._owns_engine = engine is None
        self.engine = engine or IOEngine()
        self._infos: dict[str, ArrayInfo] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._zero_crc: dict[int, int] = {}
        self._ensure_group(self.root)

    # -- arrays ----------------------------------------------------------------

    def create(
        self,
        name: str,
        numel: int,
        dtype: torch.dtype,
        chunk_elems: int | None = None,
        *,
        preallocate: bool = True,
        attributes: dict | None = None,
    ) -> ArrayInfo:
        """Create (or find, if identical) a flat array; preallocate its chunk files."""
        check_name(name)
        dtype_name(dtype)
        if numel < 0:
            raise IOArgumentError(f"TensorStore.create({name!r}): numel must be >= 0, got {numel}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if chunk_elems is None:
            chunk_elems = default_chunk_elems(numel, itemsize)
        if chunk_elems < 1:
            raise IOArgumentError(f"TensorStore.create({name!r}): chunk_elems must be >= 1, got {chunk_elems}")
        info = ArrayInfo(name, int(numel), dtype, int(chunk_elems))
        directory = self._dir(name)
        meta_path = os.path.join(directory, "zarr.json")
        if os.path.exists(meta_path):
            have = parse_array(name, read_metadata(meta_path))
            if have != info:
                raise ArrayExistsError(
                    errno.EEXIST,
                    f"TensorStore: array {name!r} exists as {have.numel} x {have.dtype} chunked by "
                    f"{have.chunk_elems}; asked for {info.numel} x {info.dtype} chunked by "
                    f"{info.chunk_elems}. delete() it first to change it",
                )
        else:
            self._ensure_parents(name)
            self._makedirs(os.path.join(directory, "c"))
            attrs = dict(attributes or {})
            meta = array_metadata(info, attrs)
            meta["attributes"]["zeroio"]["preallocated"] = bool(preallocate)
            self._write_json(meta_path, meta)
        with self._lock:
            self._infos[name] = info
        if preallocate:
            self._preallocate(info)
        return info

    def info(self, name: str) -> ArrayInfo:
        with self._lock:
            info = self._infos.get(name)
        if info is not None:
            return info
        check_name(name)
        meta_path = os.path.join(self._dir(name), "zarr.json")
        try:
            meta = read_metadata(meta_path)
        except FileNotFoundError:
            raise ArrayNotFoundError(
                errno.ENOENT, f"TensorStore: no array {name!r} in {self.root} (create() it first)"
            ) from None
        info = parse_array(name, meta)
        with self._lock:
            self._infos[name] = info
        return info

    def has(self, name: str) -> bool:
        check_name(name)
        return os.path.exists(os.path.join(self._dir(name), "zarr.json"))

    def delete(self, name: str) -> None:
        check_name(name)
        with self._lock:
            self._infos.pop(name, None)
        shutil.rmtree(self._dir(name), ignore_errors=True)

    def sync(self, name: str) -> None:
        """fsync every chunk file of ``name`` (durability, e.g. before a checkpoint manifest)."""
        info = self.info(name)
        for k in range(info.nchunks):
            path = self._chunk_path(name, k)
            if os.path.exists(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- data ------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Write ``tensor`` (flattened) at element ``offset``; result: bytes written."""
        info = self.info(name)
        mem = self._check_range(info, tensor, offset, "write")
        return self._per_chunk(info, mem, offset, self._write_chunk, mem.nbytes)

    def read_into(self, name: str, out: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``out`` (flattened) from element ``offset``; result: ``out``.

        On error the future raises and ``out``'s contents are undefined.
        """
        info = self.info(name)
        mem = self._check_range(info, out, offset, "read_into")
        return self._per_chunk(info, mem, offset, self._read_chunk, out)

    def read(self, name: str, offset: int = 0, numel: int | None = None) -> Future:
        """Read into a new (aligned when possible) tensor; result: that tensor."""
        info = self.info(name)
        numel = info.numel - offset if numel is None else numel
        out = AlignedBuffer(numel * info.itemsize, pin=False).view(info.dtype, numel)
        return self.read_into(name, out, offset)

    # -- internals ---------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def _chunk_path(self, name: str, k: int) -> str:
        return os.path.join(self._dir(name), "c", str(k))

    def _ensure_group(self, directory: str) -> None:
        meta = os.path.join(directory, "zarr.json")
        if not os.path.exists(meta):
            self._write_json(meta, group_metadata())

    def _ensure_parents(self, name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = os.path.join(self.root, *parts[:i])
            self._makedirs(d)
            self._ensure_group(d)

    def _makedirs(self, d: str) -> None:
        if self.private:
            from zeroio.io.swapdir import make_private_dirs

            make_private_dirs(d)
        else:
            os.makedirs(d, exist_ok=True)

    def _write_json(self, path: str, obj: dict) -> None:
        # atomic, not durable: a crash discards swap state anyway ([Note: atomic writes] in files.py)
        atomic_write_text(path, metadata_json(obj), mode=0o600 if self.private else None, durable=False)

    def _create_private(self, path: str) -> None:
        """A private store's chunk file exists 0600 before the engine opens it (O_CREAT there
        would give the engine's default mode)."""
        if self.private and not os.path.exists(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)

    def _check_range(self, info: ArrayInfo, t: torch.Tensor, offset: int, op: str) -> np.ndarray:
        if t.dtype != info.dtype:
            raise IOArgumentError(
                f"TensorStore.{op}({info.name!r}): tensor dtype {t.dtype} != array dtype {info.dtype}"
            )
        n = t.numel()
        if offset < 0 or offset + n > info.numel:
            raise IOArgumentError(
                f"TensorStore.{op}({info.name!r}): range [{offset}, {offset + n}) is outside the "
                f"array's {info.numel} elements"
            )
        return tensor_bytes(t)

    def _per_chunk(self, info: ArrayInfo, mem: np.ndarray, offset: int, fn, result: object) -> Future:
        """Run ``fn(info, k, first, last, mem_part)`` for each chunk the range touches."""
        out: Future = Future()
        out.set_running_or_notify_cancel()
        n = mem.nbytes // info.itemsize
        if n == 0:
            out.set_result(result)
            return out
        first_chunk = offset // info.chunk_elems
        last_chunk = (offset + n - 1) // info.chunk_elems
        gather = _Gather(out, last_chunk - first_chunk + 1, result, lambda: None)
        for k in range(first_chunk, last_chunk + 1):
            base = k * info.chunk_elems
            a = max(offset, base) - base
            b = min(offset + n, base + info.chunk_elems) - base
            part = mem[(base + a - offset) * info.itemsize : (base + b - offset) * info.itemsize]
            fut = self.engine.submit(fn, info, k, a, b, part)
            fut.add_done_callback(gather.part_done)
        return out

    def _stage(self, nbytes: int) -> np.ndarray:
        buf: AlignedBuffer | None = getattr(self._local, "stage", None)
        if buf is None or buf.capacity < nbytes:
            buf = AlignedBuffer(nbytes, pin=False)
            self._local.stage = buf
        return buf.full.numpy()[:nbytes]

    def _integrity(self, info: ArrayInfo, k: int, what: str) -> IntegrityError:
        return IntegrityError(
            errno.EIO,
            f"TensorStore: array {info.name!r} chunk {k} ({self._chunk_path(info.name, k)}): {what}; "
            "the data was not used",
        )

    def _load_chunk(self, info: ArrayInfo, k: int, files: _Files, fd: int, stage: np.ndarray) -> None:
        """Read and verify chunk ``k`` into ``stage`` (chunk_bytes); zeros if never written."""
        size = os.fstat(fd).st_size
        if size == 0:
            stage[:] = 0
            return
        if size != info.file_bytes:
            raise self._integrity(info, k, f"file is {size} bytes, expected {info.file_bytes} (truncated)")
        self._pread(info, k, files, stage, 0)
        self._verify(info, k, files, crc32c(stage))

    def _pread(self, info: ArrayInfo, k: int, files: _Files, mem: np.ndarray, offset: int) -> None:
        try:
            self.engine.pread_into(files, mem, offset)
        except IntegrityError as e:
            raise self._integrity(info, k, f"short read ({e.strerror})") from e

    def _verify(self, info: ArrayInfo, k: int, files: _Files, crc: int) -> None:
        stored = np.empty(CRC_BYTES, dtype=np.uint8)
        self._pread(info, k, files, stored, info.chunk_bytes)
        want = int.from_bytes(stored.tobytes(), "little")
        if want != crc:
            raise self._integrity(info, k, f"crc32c mismatch (stored {want:#010x}, computed {crc:#010x})")

    def _write_crc(self, files: _Files, info: ArrayInfo, crc: int) -> None:
        tail = np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), dtype=np.uint8).copy()
        self.engine.pwrite_from(files, tail, info.chunk_bytes)

    def _write_chunk(self, info: ArrayInfo, k: int, a: int, b: int, src: np.ndarray) -> None:
        path = self._chunk_path(info.name, k)
        self._create_private(path)
        files = self.engine.open_files(path, "rw")
        try:
            fd = files.direct if files.direct is not None else files.buffered
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink > 1:  # a checkpoint shares it: [Note: shared chunk files]
                self._replace_chunk(info, k, a, b, src, files, fd)
            else:
                self._fill_chunk(info, k, a, b, src, files, files, fd)
        finally:
            self.engine.close_files(files)

    def _fill_chunk(self, info: ArrayInfo, k: int, a: int, b: int, src: np.ndarray, dst: _Files,
                    old: _Files, old_fd: int) -> None:
        """Write elements [a, b) of chunk ``k`` and its crc into ``dst``; a partial write merges
        the rest of the chunk from ``old`` (read-modify-write, [Note: concurrent range writes])."""
        valid = info.valid_elems(k)
        if a == 0 and b >= valid:  # whole chunk: no read needed
            self.engine.pwrite_from(dst, src, 0)
            crc = crc32c(src)
            pad = info.chunk_bytes - src.nbytes
            if pad:
                self.engine.pwrite_from(dst, np.zeros(pad, dtype=np.uint8), src.nbytes)
                crc = zeros_crc(pad, crc)
        else:
            stage = self._stage(info.chunk_bytes)
            self._load_chunk(info, k, old, old_fd, stage)
            stage[a * info.itemsize : b * info.itemsize] = src
            self.engine.pwrite_from(dst, stage, 0)
            crc = crc32c(stage)
        self._write_crc(dst, info, crc)

    def _replace_chunk(self, info: ArrayInfo, k: int, a: int, b: int, src: np.ndarray,
                       old: _Files, old_fd: int) -> None:
        """Write chunk ``k`` to a new file renamed over the shared one (its lock still held).

        [Note: shared chunk files] A checkpoint may hard-link a chunk file
        (zeroio/io/links.py) instead of copying it. A hard link is the same inode, so a
        write in place would change the checkpoint. A chunk file with more than one link is
        therefore never written in place: the new bytes go to a fresh file in the same
        folder, which is renamed over the old name. The name now has a new inode; the old
        one lives on as the checkpoint's file, unchanged, until the checkpoint is removed.
        Swap writes are whole chunks (a piece is one array), so breaking a link copies
        nothing: it costs one create and one rename, once per chunk and per checkpoint,
        on the first write-back after the save. Files that are not shared (``st_nlink``
        1: every chunk outside a save, and reflinked ones, whose sharing is the file
        system's copy-on-write) are written in place as before. The link count is read
        under the chunk's exclusive lock, which the linker's shared lock excludes, so a
        link cannot appear between the check and the write.
        """
        path = self._chunk_path(info.name, k)
        tmp = os.path.join(os.path.dirname(path), f".{k}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600 if self.private else 0o644)
        if self.private:
            os.fchmod(fd, 0o600)
        os.close(fd)
        new = self.engine.open_files(tmp, "rw")
        try:
            self._fill_chunk(info, k, a, b, src, new, old, old_fd)
        except BaseException:
            self.engine.close_files(new)
            os.unlink(tmp)
            raise
        self.engine.close_files(new)
        os.replace(tmp, path)

    def chunk_files(self, name: str) -> list[tuple[str, int, int]]:
        """(path, first element, elements) of each chunk file of ``name``, for sharing with a
        checkpoint (zeroio/io/links.py). Each file is ``info(name).file_bytes`` long: the
        chunk's ``chunk_bytes`` (padded) and their crc32c."""
        info = self.info(name)
        return [(self._chunk_path(name, k), k * info.chunk_elems, info.valid_elems(k))
                for k in range(info.nchunks)]

    def _read_chunk(self, info: ArrayInfo, k: int, a: int, b: int, dst: np.ndarray) -> None:
        path = self._chunk_path(info.name, k)
        if not os.path.exists(path):
            if self._preallocated(info):
                raise self._integrity(info, k, "chunk file is missing")
            dst[:] = 0  # never written: zarr's fill value
            return
        files = self.engine.open_files(path, "r")
        try:
            fd = files.direct if files.direct is not None else files.buffered
            fcntl.flock(fd, fcntl.LOCK_SH)
            size = os.fstat(fd).st_size
            if size == 0:
                dst[:] = 0
                return
            if size != info.file_bytes:
                raise self._integrity(info, k, f"file is {size} bytes, expected {info.file_bytes} (truncated)")
            valid = info.valid_elems(k)
            if a == 0 and b >= valid:  # whole chunk: straight into the caller's buffer
                self._pread(info, k, files, dst, 0)
                crc = crc32c(dst)
                pad = info.chunk_bytes - dst.nbytes
                if pad:
                    padding = np.empty(pad, dtype=np.uint8)
                    self._pread(info, k, files, padding, dst.nbytes)
                    crc = crc32c(padding, crc)
                self._verify(info, k, files, crc)
            else:
                stage = self._stage(info.chunk_bytes)
                self._load_chunk(info, k, files, fd, stage)
                dst[:] = stage[a * info.itemsize : b * info.itemsize]
        finally:
            self.engine.close_files(files)

    def _preallocated(self, info: ArrayInfo) -> bool:
        meta = read_metadata(os.path.join(self._dir(info.name), "zarr.json"))
        return bool(meta.get("attributes", {}).get("zeroio", {}).get("preallocated", False))

    def _preallocate(self, info: ArrayInfo) -> None:
        """Reserve every chunk file now; each starts as a valid chunk of zeros."""
        paths = [self._chunk_path(info.name, k) for k in range(info.nchunks)]
        missing = [p for p in paths if not os.path.exists(p) or os.path.getsize(p) == 0]
        needed = len(missing) * info.file_bytes
        ops = self.engine.ops
        if needed and needed > ops.disk_free(self._dir(info.name)):
            raise no_space_error(ops, self._dir(info.name), needed)
        if info.chunk_bytes not in self._zero_crc:
            self._zero_crc[info.chunk_bytes] = zeros_crc(info.chunk_bytes)
        for path in missing:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600 if self.private else 0o644)
            try:
                if self.private:
                    os.fchmod(fd, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_size == 0:  # a concurrent writer may have got here first
                    try:
                        ops.posix_fallocate(fd, 0, info.file_bytes)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.EDQUOT):
                            os.ftruncate(fd, 0)
                            raise no_space_error(ops, path, needed) from e
                        raise SwapIOError(e.errno or errno.EIO, f"preallocate {path}: {e.strerror}") from e
                    os.pwrite(fd, self._zero_crc[info.chunk_bytes].to_bytes(CRC_BYTES, "little"), info.chunk_bytes)
            finally:
                os.close(fd)
