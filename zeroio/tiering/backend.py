"""The NVMe tier's storage boundary: named flat arrays, asynchronous transfers.

The store only needs five operations, so the NVMe tier talks to this small
interface; ``TensorStoreBackend`` (zeroio/tiering/nvme.py) puts it on the I/O
layer's zarr ``TensorStore`` and ``MemoryBackend`` keeps bytes in host memory
for tests (with failure injection, so I/O error paths can be exercised).

Contract: ``create`` makes an array of ``numel`` elements that reads back as
zeros until written; ``write``/``read_into`` take contiguous CPU tensors and
return futures (the tensor must not change or be freed until the future is
done); errors surface through the future as ``SwapIOError``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zeroio.errors import SwapIOError


class NvmeBackend(ABC):
    @abstractmethod
    def create(self, name: str, numel: int, dtype: torch.dtype) -> None: ...

    @abstractmethod
    def write(self, name: str, tensor: torch.Tensor) -> Future: ...

    @abstractmethod
    def read_into(self, name: str, out: torch.Tensor) -> Future: ...

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def names(self) -> list[str]:
        """Arrays that exist now (a closed store must have none)."""

    @abstractmethod
    def close(self) -> None: ...

    def files_of(self, name: str) -> list[tuple[str, int, int, int, int]] | None:
        """The files holding ``name``: (path, first element, elements, file bytes, crc offset)
        each, which a checkpoint may share instead of copying ([Note: shared chunk files] in
        zeroio/io/store.py); None when the array is not in files (default)."""
        return None


class MemoryBackend(NvmeBackend):
    """Arrays as host byte strings, transferred on a small thread pool.

    ``fail_next(op, name)`` makes the next ``op`` ("read" or "write") of
    ``name`` fail with ``SwapIOError``, as a failing disk would.
    """

    def __init__(self, threads: int = 2):
        self._data: dict[str, bytearray] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroio-membackend")
        self._failures: set[tuple[str, str]] = set()

    def fail_next(self, op: str, name: str) -> None:
        with self._lock:
            self._failures.add((op, name))

    def create(self, name: str, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            self._data[name] = bytearray(nbytes)

    def write(self, name: str, tensor: torch.Tensor) -> Future:
        return self._pool.submit(self._write, name, tensor)

    def read_into(self, name: str, out: torch.Tensor) -> Future:
        return self._pool.submit(self._read, name, out)

    def delete(self, name: str) -> None:
        with self._lock:
            self._data.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            self._data.clear()

    def _take_failure(self, op: str, name: str) -> None:
        with self._lock:
            if (op, name) in self._failures:
                self._failures.discard((op, name))
                raise SwapIOError(f"memory backend: injected {op} failure of {name!r}")

    def _write(self, name: str, tensor: torch.Tensor) -> int:
        self._take_failure("write", name)
        raw = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        with self._lock:
            buf = self._data.get(name)
            if buf is None or len(buf) != len(raw):
                raise SwapIOError(f"memory backend: write of {name!r}: no array of {len(raw)} bytes")
            buf[:] = raw
        return len(raw)

    def _read(self, name: str, out: torch.Tensor) -> torch.Tensor:
        self._take_failure("read", name)
        dst = out.detach().reshape(-1).view(torch.uint8)
        with self._lock:
            buf = self._data.get(name)
            if buf is None or len(buf) != dst.numel():
                raise SwapIOError(f"memory backend: read of {name!r}: no array of {dst.numel()} bytes")
            src = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else dst[:0]
        dst.copy_(src)
        return out
