"""zarr v3 metadata of flat 1-D arrays: the one zarr-metadata module of zeroio.

Two array kinds share it: a TensorStore's (swap state; each chunk file carries
its own crc32c, below) and a checkpoint's (`raw_array_metadata`: raw chunks
only, their crcs live in the checkpoint's manifest). Groups of both are
`group_metadata` with the owner's attributes.

[Note: chunk files] An array ``name`` with ``numel`` elements of ``itemsize``
bytes, chunked by ``chunk_elems``, is the directory ``root/name`` holding
``zarr.json`` and chunk files ``c/0, c/1, ...``. The codec chain is
``bytes(little endian) -> crc32c``, so every chunk file is exactly
``chunk_bytes = chunk_elems * itemsize`` raw little-endian bytes followed by
the 4-byte little-endian crc32c of those bytes: the zarr spec's own checksum,
so ``zarr.open`` verifies it too. The last chunk is full size, padded with the
fill value 0 (zarr requires full edge chunks). 16-bit floats are stored as
``uint16`` raw bits; every array names its torch dtype in
``attributes["zeroio"]["torch_dtype"]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroio import jsonlimits
from zeroio.errors import ZeroIOError
from zeroio.io.buffers import ALIGN, round_up

CRC_BYTES = 4
DEFAULT_CHUNK_BYTES = 64 << 20
FORMAT_VERSION = 1

# torch dtype name -> zarr v3 data_type (16-bit floats as raw bits)
_ZARR_TYPES = {
    "float32": "float32",
    "float64": "float64",
    "float16": "uint16",
    "bfloat16": "uint16",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "bool": "bool",
}

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


class InvalidArrayName(ZeroIOError, ValueError):
    """An array name that cannot be a zarr node path."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _ZARR_TYPES:
        raise InvalidArrayName(
            f"TensorStore: dtype {dtype} is not supported; use one of {sorted(_ZARR_TYPES)}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_name(name: str) -> str:
    parts = name.split("/")
    if not _NAME.match(name) or any(p in (".", "..") or p.startswith("__") for p in parts):
        raise InvalidArrayName(
            f"TensorStore: array name {name!r} is not a valid zarr path; use letters, digits, "
            "'_', '-', '.' and '/' between parts (no '..', no part starting with '__')"
        )
    if parts[-1] == "c" or "zarr.json" in parts:
        raise InvalidArrayName(f"TensorStore: array name {name!r} collides with zarr's own files")
    return name


@dataclass(frozen=True)
class ArrayInfo:
    """What ``zarr.json`` says about one flat array."""

    name: str
    numel: int
    dtype: torch.dtype
    chunk_elems: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_elems * self.itemsize

    @property
    def file_bytes(self) -> int:
        """Size of every chunk file: data plus crc."""
        return self.chunk_bytes + CRC_BYTES

    @property
    def nchunks(self) -> int:
        return -(-self.numel // self.chunk_elems)

    def valid_elems(self, chunk: int) -> int:
        """Elements of ``chunk`` inside the array (the rest is padding)."""
        return min(self.chunk_elems, self.numel - chunk * self.chunk_elems)


def default_chunk_elems(numel: int, itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Chunks of at most ``target_bytes``, balanced, each a multiple of 4096 bytes."""
    nbytes = max(numel * itemsize, 1)
    count = -(-nbytes // target_bytes)
    return round_up(-(-nbytes // count), ALIGN) // itemsize


def array_metadata(info: ArrayInfo, attributes: dict | None = None) -> dict:
    name = dtype_name(info.dtype)
    zarr_type = _ZARR_TYPES[name]
    attrs = dict(attributes or {})
    attrs["zeroio"] = {"torch_dtype": name, "format": FORMAT_VERSION}
    bytes_codec: dict = {"name": "bytes"}
    if info.itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [info.numel],
        "data_type": zarr_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [info.chunk_elems]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if zarr_type == "bool" else 0,
        "codecs": [bytes_codec, {"name": "crc32c"}],
        "attributes": attrs,
        "dimension_names": None,
        "storage_transformers": [],
    }


def raw_array_metadata(numel: int, dtype: torch.dtype, chunk_elems: int,
                       attributes: dict | None = None) -> dict:
    """A flat array of raw little-endian chunks, no checksum codec (a checkpoint's arrays:
    the manifest holds their chunk crcs); `zarr.open_array` reads it as-is."""
    name = dtype_name(dtype)
    zarr_type = _ZARR_TYPES[name]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [numel],
        "data_type": zarr_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_elems]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0 if zarr_type.startswith("float") else 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {"torch_dtype": name, **(attributes or {})},
        "dimension_names": None,
    }


def group_metadata(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes or {})}


def parse_array(name: str, meta: dict) -> ArrayInfo:
    try:
        dtype = torch_dtype(meta["attributes"]["zeroio"]["torch_dtype"])
        (numel,) = meta["shape"]
        (chunk_elems,) = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = [c["name"] for c in meta["codecs"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InvalidArrayName(f"TensorStore: {name!r} is not an array written by zeroio ({e!r})") from e
    if codecs != ["bytes", "crc32c"]:
        raise InvalidArrayName(f"TensorStore: {name!r} uses codecs {codecs}; zeroio reads only bytes+crc32c")
    return ArrayInfo(name, int(numel), dtype, int(chunk_elems))


def metadata_json(meta: dict) -> str:
    """The text of a TensorStore's ``zarr.json``."""
    return json.dumps(meta, indent=2)


def read_metadata(path: str) -> dict:
    """A ``zarr.json`` (FileNotFoundError when there is none)."""
    return jsonlimits.loads(Path(path).read_text(), f"array metadata {path}")
