"""Where things are in a checkpoint directory, and the manifest that makes a tag real.

    <dir>/latest                    the newest complete tag (text, renamed into place)
    <dir>/<tag>/zarr.json           zarr v3 group; attributes mark it a zeroio checkpoint
    <dir>/<tag>/<kind>/zarr.json    zarr v3 array: 1-D, raw little-endian chunks
    <dir>/<tag>/<kind>/c/<i>        chunk i (the last one zero-padded to full size)
    <dir>/<tag>/done/rank-<r>.json  rank r wrote and synced its pieces (with their crcs)
    <dir>/<tag>/manifest.json       the commit point: written last, renamed into place

[Note: atomic tags] A tag is a checkpoint only once manifest.json exists. The
manifest is written by rank 0 after every rank's done marker is present, to a
temp file that is renamed into place; `latest` is updated only after that.
A crash at any earlier point leaves a tag directory without a manifest,
which loading ignores and reports.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroio.checkpoint.state import ParamEntry
from zeroio.checkpoint.storage import read_json
from zeroio.errors import CheckpointError

FORMAT = "zeroio-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
DONE_DIR = "done"
DEFAULT_CHUNK_BYTES = 64 << 20

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")

# torch dtype -> zarr v3 data_type of the stored bits (16-bit floats as raw bits, see DESIGN.md)
_ZARR_DTYPE = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "uint16",
    torch.bfloat16: "uint16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
}
_TORCH_DTYPE = {str(d).removeprefix("torch."): d for d in _ZARR_DTYPE}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _ZARR_DTYPE:
        raise CheckpointError(f"dtype {dtype} cannot be stored; use one of {sorted(_TORCH_DTYPE)}")
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPE[name]
    except KeyError:
        raise CheckpointError(f"unknown stored dtype {name!r}; known: {sorted(_TORCH_DTYPE)}") from None


def check_name(kind: str, what: str) -> str:
    if not _NAME_RE.match(kind):
        raise CheckpointError(f"{what} {kind!r} must match {_NAME_RE.pattern}")
    return kind


def tag_dir(root: str | os.PathLike, tag: str) -> Path:
    return Path(root) / check_name(tag, "tag")


def chunk_path(tdir: Path, kind: str, i: int) -> Path:
    return tdir / kind / "c" / str(i)


def group_metadata() -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"zeroio": {"format": FORMAT, "format_version": FORMAT_VERSION}},
    }


def array_metadata(numel: int, dtype: torch.dtype, chunk_elems: int) -> dict[str, Any]:
    """zarr v3 metadata of a flat raw array; `zarr.open_array` reads it as-is."""
    zdt = _ZARR_DTYPE[dtype]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [numel],
        "data_type": zdt,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_elems]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0 if zdt.startswith("float") else 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {"torch_dtype": dtype_name(dtype)},
        "dimension_names": None,
    }


@dataclass(frozen=True, kw_only=True)
class ArrayInfo:
    """One flat array as the manifest records it."""

    kind: str
    numel: int
    dtype: torch.dtype
    chunk_elems: int
    chunk_crc32c: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.numel / self.chunk_elems) if self.numel else 0

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk_elems * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "dtype": dtype_name(self.dtype),
            "chunk_elems": self.chunk_elems,
            "chunk_crc32c": list(self.chunk_crc32c),
        }


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A parsed, validated manifest.json."""

    path: Path
    tag: str
    world_size: int
    index: dict[str, ParamEntry]
    arrays: dict[str, ArrayInfo]
    scalars: dict[str, Any]
    rank_scalars: list[dict[str, Any]]
    client_state: dict[str, Any]
    meta: dict[str, Any]
    created_unix: float

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.index.values())

    @property
    def tag_dir(self) -> Path:
        return self.path.parent


def manifest_json(*, tag, world_size, index, arrays, scalars, rank_scalars, client_state, meta, created_unix):
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "created_unix": created_unix,
        "world_size": world_size,
        "meta": meta,
        "model": {
            "numel": sum(e.numel for e in index.values()),
            "index": [[name, e.offset, list(e.shape)] for name, e in index.items()],
        },
        "arrays": {k: a.to_json() for k, a in arrays.items()},
        "scalars": scalars,
        "client_state": client_state,
        "rank_scalars": rank_scalars,
    }


def _field(doc: dict, key: str, typ, path: Path):
    if key not in doc or not isinstance(doc[key], typ):
        raise CheckpointError(f"manifest {path} has no valid {key!r} field; the file is damaged")
    return doc[key]


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse manifest.json; a newer format version or a damaged file is a CheckpointError."""
    path = Path(path)
    doc = read_json(path, "checkpoint manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zeroio checkpoint manifest (format != {FORMAT!r})")
    version = doc.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"manifest {path} has no integer format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"manifest {path} has format_version {version}; this zeroio reads up to "
            f"{FORMAT_VERSION}. Upgrade zeroio to load it."
        )
    model = _field(doc, "model", dict, path)
    index = {
        name: ParamEntry(offset=int(off), shape=tuple(int(s) for s in shape))
        for name, off, shape in _field(model, "index", list, path)
    }
    arrays = {}
    for kind, a in _field(doc, "arrays", dict, path).items():
        info = ArrayInfo(
            kind=kind,
            numel=int(a["numel"]),
            dtype=torch_dtype(a["dtype"]),
            chunk_elems=int(a["chunk_elems"]),
            chunk_crc32c=tuple(int(c) for c in a["chunk_crc32c"]),
        )
        if len(info.chunk_crc32c) != info.num_chunks:
            raise CheckpointError(
                f"manifest {path}: array {kind!r} lists {len(info.chunk_crc32c)} chunk crcs "
                f"for {info.num_chunks} chunks; the file is damaged"
            )
        arrays[kind] = info
    return Manifest(
        path=path,
        tag=str(_field(doc, "tag", str, path)),
        world_size=int(_field(doc, "world_size", int, path)),
        index=index,
        arrays=arrays,
        scalars=_field(doc, "scalars", dict, path),
        rank_scalars=_field(doc, "rank_scalars", list, path),
        client_state=_field(doc, "client_state", dict, path),
        meta=_field(doc, "meta", dict, path),
        created_unix=float(doc.get("created_unix", 0.0)),
    )


@dataclass(frozen=True, kw_only=True)
class TagStatus:
    """A tag directory found in a checkpoint directory."""

    tag: str
    path: Path
    complete: bool
    reason: str  # "" when complete; why not otherwise
    created_unix: float


def scan_tags(root: str | os.PathLike) -> list[TagStatus]:
    """Every zeroio tag directory under ``root``, oldest first; incomplete ones included."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return found
    for d in root.iterdir():
        if not d.is_dir() or not (d / "zarr.json").is_file():
            continue
        try:
            attrs = json.loads((d / "zarr.json").read_text()).get("attributes", {})
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(attrs, dict) or "zeroio" not in attrs:
            continue
        man = d / MANIFEST
        if not man.exists():
            done = len(list((d / DONE_DIR).glob("rank-*.json"))) if (d / DONE_DIR).is_dir() else 0
            found.append(TagStatus(
                tag=d.name, path=d, complete=False, created_unix=d.stat().st_mtime,
                reason=f"no {MANIFEST}: the save was interrupted ({done} rank(s) had finished)",
            ))
            continue
        try:
            m = read_manifest(man)
            found.append(TagStatus(tag=d.name, path=d, complete=True, reason="", created_unix=m.created_unix))
        except CheckpointError as e:
            found.append(TagStatus(tag=d.name, path=d, complete=False, reason=str(e),
                                   created_unix=man.stat().st_mtime))
    found.sort(key=lambda s: (s.created_unix, s.tag))
    return found


def read_latest(root: str | os.PathLike) -> str | None:
    p = Path(root) / LATEST
    try:
        tag = p.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return tag or None
