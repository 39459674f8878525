"""Async I/O: aligned (pinned) host buffers, the direct-I/O engine, the zarr tensor store,
GPU copy helpers, and the file access of checkpoints and exports (``files``, ``crc``).
See docs/io.md."""

from zeroio.io.buffers import ALIGN, AlignedBuffer, BufferPool
from zeroio.io.engine import IOArgumentError, IOEngine
from zeroio.io.layout import ArrayInfo, InvalidArrayName
from zeroio.io.osops import OsOps
from zeroio.io.settings import EngineSettings
from zeroio.io.store import ArrayExistsError, ArrayNotFoundError, TensorStore

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BufferPool",
    "IOEngine",
    "IOArgumentError",
    "EngineSettings",
    "OsOps",
    "TensorStore",
    "ArrayInfo",
    "ArrayNotFoundError",
    "ArrayExistsError",
    "InvalidArrayName",
]
