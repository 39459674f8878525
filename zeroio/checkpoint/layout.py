"""Where things are in a checkpoint directory, and the manifest that makes a tag real.

    <dir>/latest                    the newest complete tag (text, renamed into place)
    <dir>/<tag>/zarr.json           zarr v3 group; attributes mark it a zeroio checkpoint
    <dir>/<tag>/<kind>/zarr.json    zarr v3 array: 1-D, raw little-endian chunks
    <dir>/<tag>/<kind>/c/<i>        chunk i (the last one zero-padded to full size)
    <dir>/<tag>/<kind>/x/r<R>-<N>   an extent file of a kind stored as extents (format 3:
                                    NVMe swap files shared, [Note: shared extents] in shared.py)
    <dir>/<tag>/done/rank-<r>.json  rank r wrote and synced its pieces (with their crcs)
    <dir>/<tag>/manifest.json       the commit point: written last, renamed into place

[Note: atomic tags] A copy is complete only once manifest.json exists. The
manifest is written by rank 0 after every rank's done marker is present, to a
temp file that is renamed into place, inside the staging folder the whole
save writes to; the staging folder then becomes the tag ([Note: re-saving a
tag] in tags.py) and `latest` is updated only after that.

[Note: manifest checks] A manifest is trusted only after: its format version
is one this zeroio reads; its `manifest_crc32c` equals the crc32c of the rest
of the document (canonical JSON: sorted keys, no spaces), so a damaged or
hand-edited manifest is refused; every array name is one safe path component
(it becomes a folder name); the index entries tile [0, numel) exactly (no
gap, no overlap, in bounds) and every array has numel elements and one crc
per chunk. Only then is a byte of a chunk used.
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
from zeroio.errors import CheckpointError
from zeroio.io import layout as zarr_layout
from zeroio.io.crc import crc32c
from zeroio.io.files import read_json


class CheckpointWarning(UserWarning):
    """A checkpoint directory holds something that was skipped (an interrupted save)."""

FORMAT = "zeroio-checkpoint"
FORMAT_VERSION = 3  # 3: arrays stored as extents; 2: manifest_crc32c; 1: neither (still read)
CHUNKED_VERSION = 2  # what a checkpoint without extents is written as (older readers read it)
CRC_KEY = "manifest_crc32c"
MANIFEST = "manifest.json"
LATEST = "latest"
DONE_DIR = "done"
DEFAULT_CHUNK_BYTES = 64 << 20

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
EXTENTS_DIR = "x"
EXTENT_RE = re.compile(r"^r[0-9]{5}-[0-9]{6}$")

# the dtypes a checkpoint stores (16-bit floats as raw bits, see DESIGN.md and zeroio.io.layout)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8)
_TORCH_DTYPE = {str(d).removeprefix("torch."): d for d in _DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored; use one of {sorted(_TORCH_DTYPE)}")
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPE[name]
    except KeyError:
        raise CheckpointError(f"unknown stored dtype {name!r}; known: {sorted(_TORCH_DTYPE)}") from None


def valid_name(name) -> bool:
    """One safe path component: letters, digits, '_', '-', '.'; not '.', '..' or hidden."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and not name.startswith(".")


def check_name(kind: str, what: str) -> str:
    if not valid_name(kind):
        raise CheckpointError(f"{what} {kind!r} must be one folder name matching {_NAME_RE.pattern}, "
                              "not starting with '.'")
    return kind


def chunk_path(tdir: Path, kind: str, i: int) -> Path:
    return tdir / kind / "c" / str(i)


def extent_path(tdir: Path, kind: str, name: str) -> Path:
    return tdir / kind / EXTENTS_DIR / name


def extent_name(rank: int, i: int) -> str:
    return f"r{rank:05d}-{i:06d}"


def extents_metadata(dtype: torch.dtype) -> dict[str, Any]:
    """The zarr.json of a kind stored as extents: a zarr group (its files are not zarr
    chunks) whose attributes name the layout; the manifest lists the extents."""
    return zarr_layout.group_metadata({"zeroio": {"layout": "extents", "dtype": dtype_name(dtype)}})


def group_metadata() -> dict[str, Any]:
    """The tag's group zarr.json: its attributes are zeroio's checkpoint marker."""
    return zarr_layout.group_metadata({"zeroio": {"format": FORMAT, "format_version": FORMAT_VERSION}})


def array_metadata(numel: int, dtype: torch.dtype, chunk_elems: int) -> dict[str, Any]:
    """zarr v3 metadata of a flat raw array; `zarr.open_array` reads it as-is."""
    dtype_name(dtype)  # a dtype checkpoints store, else a CheckpointError
    return zarr_layout.raw_array_metadata(numel, dtype, chunk_elems)


@dataclass(frozen=True, kw_only=True)
class Extent:
    """One extent file of an array stored as extents: its first ``crc_bytes`` bytes have
    crc32c ``crc32c``; ``spans`` are its (element in the file, global offset, elements) runs."""

    file: str
    crc_bytes: int
    crc32c: int
    spans: tuple[tuple[int, int, int], ...]

    def to_json(self) -> list:
        return [self.file, self.crc_bytes, self.crc32c, [list(s) for s in self.spans]]


@dataclass(frozen=True, kw_only=True)
class ArrayInfo:
    """One flat array as the manifest records it: chunked (``chunk_elems``, one crc per
    chunk), or, with ``extents``, stored as extent files (format 3)."""

    kind: str
    numel: int
    dtype: torch.dtype
    chunk_elems: int
    chunk_crc32c: tuple[int, ...]
    extents: tuple[Extent, ...] = ()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_chunks(self) -> int:
        """Chunks, or extent files: the units a reader verifies."""
        if self.extents:
            return len(self.extents)
        return math.ceil(self.numel / self.chunk_elems) if self.numel else 0

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk_elems * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict[str, Any]:
        if self.extents:
            return {"numel": self.numel, "dtype": dtype_name(self.dtype), "layout": "extents",
                    "extents": [e.to_json() for e in self.extents]}
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


def manifest_crc(doc: dict) -> int:
    """crc32c of a manifest without its own crc field ([Note: manifest checks])."""
    body = {k: v for k, v in doc.items() if k != CRC_KEY}
    return crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def seal(doc: dict) -> dict:
    """``doc`` with its `manifest_crc32c` (re)computed."""
    return {**{k: v for k, v in doc.items() if k != CRC_KEY}, CRC_KEY: manifest_crc(doc)}


def manifest_json(*, tag, world_size, index, arrays, scalars, rank_scalars, client_state, meta, created_unix):
    return seal({
        "format": FORMAT,
        "format_version": FORMAT_VERSION if any(a.extents for a in arrays.values()) else CHUNKED_VERSION,
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
    })


def _field(doc: dict, key: str, typ, path: Path):
    if key not in doc or not isinstance(doc[key], typ) or isinstance(doc[key], bool) and typ is int:
        raise CheckpointError(f"manifest {path} has no valid {key!r} field; the file is damaged")
    return doc[key]


def _int(v, what: str, path: Path, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise CheckpointError(f"manifest {path}: {what} is {v!r}, not an integer >= {lo}; the file is damaged")
    return v


def _check_version(doc, path: Path) -> int:
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
    if version >= 2:
        stored, want = doc.get(CRC_KEY), manifest_crc(doc)
        if stored != want:
            raise CheckpointError(
                f"manifest {path} is damaged or was edited: its {CRC_KEY} is {stored!r}, its "
                f"contents have {want}. Load another tag, or restore the file")
    return version


def parse_index(model: dict, path: Path) -> tuple[dict[str, ParamEntry], int]:
    """The index, checked to tile [0, numel) exactly ([Note: manifest checks])."""
    numel = _int(model.get("numel"), "model.numel", path)
    index: dict[str, ParamEntry] = {}
    for item in _field(model, "index", list, path):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[2], list)):
            raise CheckpointError(f"manifest {path}: index entry {item!r} is not [name, offset, shape]")
        name, off, shape = item
        if name in index:
            raise CheckpointError(f"manifest {path}: parameter {name!r} is listed twice in the index")
        index[name] = ParamEntry(offset=_int(off, f"the offset of {name!r}", path),
                                 shape=tuple(_int(d, f"a dimension of {name!r}", path) for d in shape))
    pos = 0
    for name, e in sorted(index.items(), key=lambda kv: (kv[1].offset, kv[1].numel)):
        if e.offset != pos:
            what = "a gap" if e.offset > pos else "an overlap"
            raise CheckpointError(
                f"manifest {path}: the index does not tile the arrays: {what} at element {min(pos, e.offset)} "
                f"({name!r} starts at {e.offset}, the entries before it end at {pos}); the file is damaged")
        pos += e.numel
    if pos != numel:
        raise CheckpointError(f"manifest {path}: the index covers {pos} elements, model.numel is {numel}; "
                              "the file is damaged")
    return index, numel


def parse_array(kind, a, numel: int, path: Path) -> ArrayInfo:
    check_name(kind, f"manifest {path}: array")
    if isinstance(a, dict) and a.get("layout") == "extents":
        return parse_extents(kind, a, numel, path)
    if not isinstance(a, dict) or not isinstance(a.get("chunk_crc32c"), list) or not isinstance(a.get("dtype"), str):
        raise CheckpointError(f"manifest {path}: array {kind!r} has no valid dtype / chunk_crc32c")
    info = ArrayInfo(
        kind=kind, numel=_int(a.get("numel"), f"array {kind!r} numel", path), dtype=torch_dtype(a["dtype"]),
        chunk_elems=_int(a.get("chunk_elems"), f"array {kind!r} chunk_elems", path, lo=1),
        chunk_crc32c=tuple(_int(c, f"a chunk crc of {kind!r}", path) for c in a["chunk_crc32c"]),
    )
    if info.numel != numel:
        raise CheckpointError(f"manifest {path}: array {kind!r} has {info.numel} elements, the index "
                              f"{numel}; the file is damaged")
    if len(info.chunk_crc32c) != info.num_chunks or any(c >> 32 for c in info.chunk_crc32c):
        raise CheckpointError(
            f"manifest {path}: array {kind!r} lists {len(info.chunk_crc32c)} chunk crcs "
            f"for {info.num_chunks} chunks; the file is damaged"
        )
    return info


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and check manifest.json ([Note: manifest checks]); anything wrong is a
    CheckpointError naming the file."""
    path = Path(path)
    doc = read_json(path, "checkpoint manifest")
    _check_version(doc, path)
    index, numel = parse_index(_field(doc, "model", dict, path), path)
    arrays = {kind: parse_array(kind, a, numel, path) for kind, a in _field(doc, "arrays", dict, path).items()}
    world_size = _int(_field(doc, "world_size", int, path), "world_size", path, lo=1)
    rank_scalars = _field(doc, "rank_scalars", list, path)
    if rank_scalars and (len(rank_scalars) != world_size or not all(isinstance(r, dict) for r in rank_scalars)):
        raise CheckpointError(f"manifest {path}: {len(rank_scalars)} rank_scalars for world_size {world_size}")
    created = doc.get("created_unix", 0.0)
    return Manifest(
        path=path,
        tag=str(_field(doc, "tag", str, path)),
        world_size=world_size,
        index=index,
        arrays=arrays,
        scalars=_field(doc, "scalars", dict, path),
        rank_scalars=rank_scalars,
        client_state=_field(doc, "client_state", dict, path),
        meta=_field(doc, "meta", dict, path),
        created_unix=float(created) if isinstance(created, (int, float)) else 0.0,
    )


def read_latest(root: str | os.PathLike) -> str | None:
    p = Path(root) / LATEST
    try:
        tag = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # missing, or not a text file: no usable `latest`
        return None
    return tag or None


def parse_extents(kind: str, a: dict, numel: int, path: Path) -> ArrayInfo:
    """An array stored as extents, checked like a chunked one ([Note: manifest checks]): safe
    file names, each span inside its file's crc-covered bytes, the spans tiling [0, numel)."""
    if not isinstance(a.get("dtype"), str) or not isinstance(a.get("extents"), list):
        raise CheckpointError(f"manifest {path}: array {kind!r} has no valid dtype / extents")
    dtype = torch_dtype(a["dtype"])
    if _int(a.get("numel"), f"array {kind!r} numel", path) != numel:
        raise CheckpointError(f"manifest {path}: array {kind!r} has {a.get('numel')} elements, the "
                              f"index {numel}; the file is damaged")
    extents = []
    for e in a["extents"]:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and EXTENT_RE.fullmatch(e[0])
                and isinstance(e[3], list)):
            raise CheckpointError(f"manifest {path}: array {kind!r} extent {str(e)[:80]} is not "
                                  "[file, crc_bytes, crc32c, spans]; the file is damaged")
        crc_bytes = _int(e[1], f"crc_bytes of extent {e[0]}", path)
        crc = _int(e[2], f"the crc of extent {e[0]}", path)
        spans = []
        for sp in e[3]:
            if not (isinstance(sp, list) and len(sp) == 3):
                raise CheckpointError(f"manifest {path}: extent {e[0]} span {sp!r} is not [at, offset, n]")
            at, off, n = (_int(v, f"a span of extent {e[0]}", path) for v in sp)
            if (at + n) * dtype.itemsize > crc_bytes:
                raise CheckpointError(f"manifest {path}: extent {e[0]} span {sp} runs past its "
                                      f"{crc_bytes} checked bytes; the file is damaged")
            spans.append((at, off, n))
        if crc >> 32:
            raise CheckpointError(f"manifest {path}: extent {e[0]} crc {crc} is not 32-bit")
        extents.append(Extent(file=e[0], crc_bytes=crc_bytes, crc32c=crc, spans=tuple(spans)))
    check_tiling(kind, extents, numel, path)
    return ArrayInfo(kind=kind, numel=numel, dtype=dtype, chunk_elems=1, chunk_crc32c=(),
                     extents=tuple(extents))


def check_tiling(kind: str, extents, numel: int, where) -> None:
    """The extents' spans cover [0, numel) exactly once."""
    pos = 0
    for off, n, name in sorted((off, n, e.file) for e in extents for _at, off, n in e.spans if n):
        if off != pos:
            raise CheckpointError(
                f"{where}: array {kind!r} extents leave {'a gap' if off > pos else 'an overlap'} at "
                f"element {min(off, pos)} (extent {name} starts at {off}); the ranks' extents do not "
                "tile the model")
        pos += n
    if pos != numel:
        raise CheckpointError(f"{where}: array {kind!r} extents cover {pos} of {numel} elements")
