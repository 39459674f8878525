"""The NVMe tier on the I/O layer's zarr ``TensorStore`` (zeroio/io/store.py).

Each registered tensor is one flat array under ``<nvme_path>/<unique>/``:
arrays are named by registration order (``s000000``...) because tensor names
(``model.layers.0.mlp.weight``, or anything a caller picks) need not be valid
zarr paths; the original name goes in the array's attributes. A fresh
subdirectory per store keeps two stores (ranks, tests) on one path apart, and
``close`` removes it: the tier holds swap space, not checkpoints. The folder is
private (0700, files 0600) and marked with its owner, so a crashed run's folder
is removed by the next store on the same path ([Note: swap folders] in
zeroio/io/swapdir.py).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import torch

from zeroio.errors import SwapIOError
from zeroio.tiering.backend import NvmeBackend


class TensorStoreBackend(NvmeBackend):
    def __init__(self, nvme_path: str | os.PathLike, aio_cfg: object = None):
        from zeroio.io import swapdir
        from zeroio.io.engine import IOEngine
        from zeroio.io.store import TensorStore

        self.root = swapdir.create(nvme_path)
        self._engine = IOEngine(aio_cfg)
        self._store = TensorStore(self.root, self._engine, private=True)
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self._counter = 0

    def _key(self, name: str) -> str:
        try:
            return self._keys[name]
        except KeyError:
            raise SwapIOError(f"NVMe tier: no array for {name!r} under {self.root}") from None

    def create(self, name: str, numel: int, dtype: torch.dtype) -> None:
        with self._lock:
            key = f"s{self._counter:06d}"
            self._counter += 1
            self._keys[name] = key
        # Preallocated chunk files read back as zeros and fail at create on ENOSPC.
        self._store.create(key, numel, dtype, attributes={"tensor_name": name})

    def write(self, name: str, tensor: torch.Tensor) -> Future:
        return self._store.write(self._key(name), tensor.reshape(-1))

    def read_into(self, name: str, out: torch.Tensor) -> Future:
        return self._store.read_into(self._key(name), out.reshape(-1))

    def files_of(self, name: str) -> list[tuple[str, int, int, int, int]]:
        key = self._key(name)
        info = self._store.info(key)
        return [(path, first, n, info.file_bytes, info.chunk_bytes)
                for path, first, n in self._store.chunk_files(key)]

    def delete(self, name: str) -> None:
        with self._lock:
            key = self._keys.pop(name, None)
        if key is not None:
            self._store.delete(key)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    def files(self) -> list[str]:
        """Array directories on disk (empty after close)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(d for d in os.listdir(self.root) if d.startswith("s"))

    def close(self) -> None:
        from zeroio.io import swapdir

        self._store.close()
        self._engine.close()
        swapdir.remove(self.root)
        self._keys.clear()  # a closed store holds no arrays (backend.py's contract)
