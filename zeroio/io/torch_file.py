"""Reading a file that ``torch.save`` wrote (DeepSpeed's ``.pt`` checkpoints) without running code.

[Note: restricted unpickling] ``torch.save`` writes a zip archive: ``<name>/data.pkl`` (a pickle
of the object tree) and one member ``<name>/data/<key>`` of raw little-endian bytes per tensor
storage. A pickle is a program: loading one with ``pickle.load`` (or ``torch.load`` with
``weights_only=False``, what DeepSpeed does) calls whatever callables it names, so a crafted
file runs code. Here the pickle stream goes through an unpickler whose ``find_class`` hands
out only callables of this module, looked up in a fixed table:

- ``torch._utils._rebuild_tensor_v2`` builds a `TensorRef` (storage, offset, shape, stride):
  a description, no tensor (``_rebuild_from_type_v2``, a tensor with Python attributes, and
  ``_rebuild_parameter`` give the same, the attributes dropped); ``torch.<T>Storage`` names a
  dtype; ``torch.Size`` gives a tuple; ``torch.<dtype>`` gives that dtype;
  ``collections.OrderedDict``, ``builtins.set`` and ``builtins.frozenset`` are containers.
- the plain classes the caller admits (``records``: DeepSpeed's loss scaler, its ZeRO-stage
  enum, ...) become `Record` objects holding the class name, the constructor arguments and the
  attribute state, nothing of the class itself: DeepSpeed need not be installed.

Any other global is a CheckpointError naming it and the file, raised before anything it names
is imported or called. The opcodes that call something (REDUCE, NEWOBJ, BUILD, ...) can only
reach what ``find_class`` returned, so nothing outside the table ever runs.

Tensor bytes are read from the archive's members by byte range (torch stores them
uncompressed), so a reader takes only the elements it needs; `verify_member` checks a
member's zip CRC-32 first, streaming it in pieces.
"""

from __future__ import annotations

import _compat_pickle
import collections
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeroio.errors import CheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool")
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header
_VERIFY_PIECE = 1 << 24  # bytes per read while a member's CRC is checked


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class StorageRef:
    """One tensor storage of a torch file: member ``member`` holds ``numel`` elements of ``dtype``."""

    path: Path
    member: str
    dtype: torch.dtype
    numel: int
    data_offset: int  # where the member's bytes start in the file
    nbytes: int  # the member's size


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """A tensor as the file describes it: a view (offset, shape, stride) of a storage. Nothing
    is read until `load` or `read`."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        want = 1
        for size, step in reversed(list(zip(self.shape, self.stride, strict=True))):
            if size != 1 and step != want:
                return False
            want *= size
        return True

    def read(self, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of this tensor flattened (row-major), as a new 1-D tensor."""
        if lo < 0 or n < 0 or lo + n > self.numel:
            raise CheckpointError(f"{self.storage.path}: elements [{lo}, {lo + n}) are outside a "
                                  f"tensor of {self.numel}")
        if not self.contiguous:
            return self.load().reshape(-1)[lo: lo + n].clone()
        return read_elements(self.storage, self.offset + lo, n)

    def load(self) -> torch.Tensor:
        """The whole tensor, with its shape."""
        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        flat = read_elements(self.storage, self.offset, span)
        return torch.as_strided(flat, self.shape, self.stride).clone()


class Record:
    """An object of an admitted plain class: its name, constructor arguments and attributes.
    Built by the unpickler in place of the class, which is never imported."""

    qualname = "?"

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    def __init__(self, *args):  # REDUCE calls the class: the arguments are kept by __new__
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.qualname}: attribute state {type(state).__name__} is not a dict")
        self.state = dict(state)

    def __repr__(self) -> str:
        return f"Record({self.qualname}, args={self.args!r}, state={self.state!r})"


def _rebuild_tensor(storage, offset, shape, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise CheckpointError(f"a tensor's storage is {type(storage).__name__}, not a storage record")
    ref = TensorRef(storage=storage, offset=int(offset), shape=tuple(int(s) for s in shape),
                    stride=tuple(int(s) for s in stride))
    end = ref.offset + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride, strict=True)) + 1
    if ref.numel and (ref.offset < 0 or end > storage.numel):
        raise CheckpointError(f"{storage.path}: a tensor of shape {ref.shape} at element {ref.offset} "
                              f"runs past its storage {storage.member} of {storage.numel} elements")
    return ref




@dataclass(frozen=True)
class _TensorType:
    name: str


def _rebuild_from_type(func, new_type, args, state=None):
    """A tensor saved with Python attributes (DeepSpeed's ``ds_id`` on its flat buffers): the
    tensor is kept, the attributes are dropped."""
    if func is not _rebuild_tensor or not isinstance(new_type, _TensorType):
        raise CheckpointError(f"a tensor is rebuilt by {func!r} as {new_type!r}; only plain tensors are read")
    return func(*args)


def _rebuild_parameter(data, requires_grad=False, hooks=None):
    if not isinstance(data, TensorRef):
        raise CheckpointError(f"a parameter's data is {type(data).__name__}, not a tensor")
    return data


def _size(dims=()):
    return tuple(int(d) for d in dims)


def _base_table() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Tensor"): _TensorType("Tensor"),
        ("torch.nn.parameter", "Parameter"): _TensorType("Parameter"),
        ("torch", "Size"): _size,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
    table.update({("torch", n): _StorageType(d) for n, d in _STORAGE_DTYPES.items()})
    table.update({("torch", n): getattr(torch, n) for n in _DTYPE_NAMES})
    return table


class _Unpickler(pickle.Unpickler):
    """Set up by `read_torch_file`; see [Note: restricted unpickling]."""

    def __init__(self, data, path: Path, prefix: str, table: dict, members: dict[str, zipfile.ZipInfo],
                 raw):
        super().__init__(data)
        self._path, self._prefix, self._table, self._members = path, prefix, table, members
        self._raw = raw  # the archive, opened for reading its members' local headers

    def find_class(self, module: str, name: str):
        # protocol 2 writes Python 2's names (``__builtin__``): read them as Python 3's
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._table[(module, name)]
        except KeyError:
            raise CheckpointError(
                f"{self._path} names {module}.{name}, which zeroio will not load: reading a "
                "checkpoint never runs code, so only tensors, containers and an allow-list of "
                "DeepSpeed's plain records are admitted. If you trust this file, load it with "
                "torch and save what you need as plain tensors and dicts") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"{self._path}: persistent id {str(pid)[:80]} is not a tensor storage")
        _tag, kind, key, _location, numel = pid
        member = f"{self._prefix}/data/{key}"
        if member not in self._members:
            raise CheckpointError(f"{self._path}: storage {key!r} has no member {member} in the archive")
        info = self._members[member]
        return StorageRef(path=self._path, member=member, dtype=kind.dtype, numel=int(numel),
                          data_offset=_data_offset(self._raw, self._path, info), nbytes=info.file_size)


@dataclass(frozen=True)
class TorchFile:
    """A parsed torch file: its object tree (tensors as `TensorRef`) and the archive's members."""

    path: Path
    obj: Any
    members: dict[str, zipfile.ZipInfo] = field(repr=False)


def read_torch_file(path: str | os.PathLike, records: dict[str, str] | None = None) -> TorchFile:
    """Parse ``path`` ([Note: restricted unpickling]). ``records``: admitted plain classes,
    ``"module.Class"`` -> a short name kept as `Record.qualname`."""
    path = Path(path)
    table = _base_table()
    for full, short in (records or {}).items():
        module, _, name = full.rpartition(".")
        table[(module, name)] = type(f"Record_{name}", (Record,), {"qualname": short})
    try:
        with open(path, "rb") as raw, zipfile.ZipFile(raw) as z:
            infos = {i.filename: i for i in z.infolist()}
            pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise CheckpointError(f"{path} is a zip archive without one <name>/data.pkl: not a "
                                      "file torch.save wrote")
            prefix = pkl[0].split("/")[0]
            order_file = f"{prefix}/byteorder"
            order = z.read(order_file).decode().strip() if order_file in infos else "little"
            if order != "little":
                raise CheckpointError(f"{path} was written on a {order}-endian machine; zeroio reads "
                                      "little-endian torch files")
            with z.open(pkl[0]) as f:
                obj = _Unpickler(f, path, prefix, table, infos, raw).load()
    except zipfile.BadZipFile:
        raise CheckpointError(f"{path} is not a zip archive: torch.save's legacy format (before "
                              "torch 1.6, or _use_new_zipfile_serialization=False) is not read; "
                              "re-save it with a current torch") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: its pickle is damaged or not a torch checkpoint ({e})") from None
    return TorchFile(path=path, obj=obj, members=infos)


def _data_offset(raw, path: Path, info: zipfile.ZipInfo) -> int:
    """Where member ``info``'s bytes start in the file (after its local header)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: member {info.filename} is compressed; torch stores tensor "
                              "bytes uncompressed, so this is not a file torch.save wrote")
    at = raw.tell()
    raw.seek(info.header_offset)
    head = raw.read(_LOCAL_HEADER.size)
    raw.seek(at)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{path}: member {info.filename} has no local header; the file is damaged")
    fields = _LOCAL_HEADER.unpack(head)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def read_elements(storage: StorageRef, lo: int, n: int) -> torch.Tensor:
    """Elements [lo, lo + n) of ``storage``, read from its member by byte range."""
    size = storage.dtype.itemsize
    if lo < 0 or (lo + n) * size > storage.nbytes:
        raise CheckpointError(f"{storage.path}: member {storage.member} holds {storage.nbytes} bytes, "
                              f"elements [{lo}, {lo + n}) of {storage.dtype} need {(lo + n) * size}; "
                              "the file is truncated or damaged")
    if n == 0:
        return torch.empty(0, dtype=storage.dtype)
    out = np.empty(n * size, dtype=np.uint8)
    try:
        with open(storage.path, "rb") as f:
            f.seek(storage.data_offset + lo * size)
            got = f.readinto(memoryview(out))
    except OSError as e:
        raise CheckpointError(f"cannot read {storage.path}: {e}") from None
    if got != out.nbytes:
        raise CheckpointError(f"{storage.path}: member {storage.member} ends early; the file is truncated")
    return torch.from_numpy(out).view(storage.dtype)


def verify_member(storage: StorageRef) -> None:
    """Read ``storage``'s member whole, in pieces, and check its zip CRC-32 and size."""
    try:
        with zipfile.ZipFile(storage.path) as z, z.open(storage.member) as f:
            total = 0
            while piece := f.read(_VERIFY_PIECE):
                total += len(piece)
    except (zipfile.BadZipFile, OSError, KeyError) as e:
        raise CheckpointError(f"{storage.path}: member {storage.member} is damaged ({e}); restore the "
                              "file or load another tag") from None
    if total < storage.numel * storage.dtype.itemsize:
        raise CheckpointError(f"{storage.path}: member {storage.member} holds {total} bytes, its "
                              f"{storage.numel} elements need {storage.numel * storage.dtype.itemsize}")
