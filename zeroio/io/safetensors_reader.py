"""Ranged reads of tensors in safetensors files (a single file or a sharded folder).

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and ``data_offsets`` (begin, end) relative to
the end of the header, then the raw little-endian bytes, each tensor
contiguous in C order. So elements ``[lo, hi)`` of a flattened tensor are one
byte range of the file, and ``read_range`` fetches exactly that with
``pread``: loading one rank's shard of a parameter never holds the whole
parameter in memory. Nothing here executes code from the file (no pickle).

    with SafetensorsReader.open(folder) as r:     # model.safetensors or an index
        r.keys(); r.shape("lm_head.weight"); r.dtype("lm_head.weight")
        r.read_range("lm_head.weight", lo, count)  # 1-D tensor of count elements

``stats`` counts the reads (``reads``, ``bytes_read``, ``largest_read_bytes``)
so callers and tests can see what was materialised.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroio import jsonlimits
from zeroio.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``file`` from byte ``start`` (absolute), ``nbytes`` long."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ReadStats:
    reads: int = 0
    bytes_read: int = 0
    largest_read_bytes: int = 0


def _parse_header(path: str, fd: int) -> dict[str, TensorEntry]:
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, no header")
    n = int.from_bytes(raw, "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path} is not a safetensors file: header length {n} does not "
                              f"fit the file's {size} bytes")
    try:
        header = jsonlimits.loads(os.pread(fd, n, 8), f"safetensors header of {path}")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from None
    base, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry "
                                  f"{meta!r}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * itemsize or begin < 0 or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({meta['dtype']} {list(shape)}) claims bytes "
                f"[{begin}, {end}) past the header; the file has {size - base} data bytes "
                "(truncated or corrupt file)")
        out[name] = TensorEntry(path, dtype, shape, base + begin, end - begin)
    return out


def checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """The safetensors files of a ``save_pretrained`` folder: the shards an index names, or the
    single file."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = jsonlimits.loads(index.read_text(encoding="utf-8"),
                                          f"safetensors index {index}")["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        return [str(folder / f) for f in sorted(set(weight_map.values()))]
    single = folder / SINGLE_NAME
    if single.is_file():
        return [str(single)]
    raise CheckpointError(f"{folder} holds neither {SINGLE_NAME} nor {INDEX_NAME}")


class SafetensorsReader:
    """Header of every file parsed once; each read is one ``pread`` of the bytes asked for."""

    def __init__(self, files: list[str | os.PathLike]):
        self.stats = ReadStats()
        self._fds: dict[str, int] = {}
        self._entries: dict[str, TensorEntry] = {}
        try:
            for f in files:
                path = str(f)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"cannot open safetensors file {path}: {e}") from None
                self._fds[path] = fd
                for name, entry in _parse_header(path, fd).items():
                    if name in self._entries:
                        raise CheckpointError(f"tensor {name!r} is in both "
                                              f"{self._entries[name].file} and {path}")
                    self._entries[name] = entry
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, folder_or_file: str | os.PathLike) -> SafetensorsReader:
        p = Path(folder_or_file)
        return cls(checkpoint_files(p) if p.is_dir() else [p])

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def entry(self, key: str) -> TensorEntry:
        try:
            return self._entries[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} is not in the safetensors files "
                                  f"{sorted(self._fds)}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self.entry(key).dtype

    def read_range(self, key: str, lo: int = 0, count: int | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, lo+count)`` of the flattened tensor ``key`` (all by default), 1-D in
        the file's dtype; into ``out`` (contiguous, that dtype, ``count`` elements) if given."""
        e = self.entry(key)
        count = e.numel - lo if count is None else count
        if lo < 0 or count < 0 or lo + count > e.numel:
            raise CheckpointError(f"{e.file}: elements [{lo}, {lo + count}) of {key!r} are "
                                  f"outside its {e.numel}")
        if out is None:
            out = torch.empty(count, dtype=e.dtype)
        elif out.dtype != e.dtype or out.numel() != count or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise ValueError(f"read_range({key!r}): out must be a contiguous host tensor of "
                             f"{count} {e.dtype}, got {out.numel()} {out.dtype} on {out.device}")
        itemsize = out.element_size()
        nbytes = count * itemsize
        if nbytes:
            view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
            self._pread_exact(e.file, view, e.start + lo * itemsize)
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        self.stats.largest_read_bytes = max(self.stats.largest_read_bytes, nbytes)
        return out

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor in its shape (for buffers and small tensors)."""
        return self.read_range(key).view(self.entry(key).shape)

    def _pread_exact(self, path: str, view: memoryview, offset: int) -> None:
        fd, done = self._fds[path], 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{path}: short read at byte {offset + done} "
                                      f"({len(view) - done} bytes missing; truncated file?)")
            done += got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["SafetensorsReader", "TensorEntry", "ReadStats", "checkpoint_files", "DTYPES"]
