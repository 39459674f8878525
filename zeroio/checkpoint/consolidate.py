"""Taking the model out: a checkpoint's weights as full tensors or a safetensors folder.

No conversion script and no engine: the manifest's index says where each
parameter lies in the flat "fp32" array, so the full tensors are read
straight from the chunks (verified, read ahead by a small pool), cast, and
written into the safetensors files window by window (`SafetensorsStream`):
memory holds a few chunks and one window (`STREAM_WINDOW` elements), never an
output shard or the model. The bytes are
those of ``safetensors.torch.save_file`` (same header, same tensor order). When the model was a Hugging Face
PreTrainedModel its config was stored in the manifest and becomes
config.json, so `from_pretrained(OUT)` loads the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from zeroio.checkpoint import deepspeed_load
from zeroio.checkpoint.layout import Manifest
from zeroio.checkpoint.reader import ArrayReader, ChunkCursor, _Request, resolve_tag
from zeroio.dtypes import DTYPES
from zeroio.errors import CheckpointError
from zeroio.io.export_dir import ExportFolder
from zeroio.io.files import PartialFile, atomic_write_text

WEIGHT_KINDS = ("fp32", "param16")  # preferred source of weights, in order
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
STREAM_WINDOW = 1 << 24  # elements per streamed piece: 64 MB of fp32
READ_AHEAD = 2  # chunks read and verified ahead of an export's writer (64 MB each by default)
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


def weight_kind(manifest: Manifest) -> str:
    for k in WEIGHT_KINDS:
        if k in manifest.arrays:
            return k
    raise CheckpointError(
        f"checkpoint {manifest.path} holds no weights array ({' or '.join(WEIGHT_KINDS)}); "
        f"it has {sorted(manifest.arrays)}"
    )


def _read_params(reader: ArrayReader, kind: str, names: list[str], dtype, desc: str) -> dict[str, torch.Tensor]:
    info = reader.info(kind)
    idx = reader.manifest.index
    out = {n: torch.empty(idx[n].shape, dtype=info.dtype) for n in names}
    reader.read_requests(kind, [_Request(idx[n].offset, out[n].view(-1)) for n in names], desc=desc)
    if dtype is not None:
        out = {n: t.to(dtype) for n, t in out.items()}
    return out


def consolidate(checkpoint_dir: str | os.PathLike, tag: str | None = None, *,
                dtype: str | torch.dtype | None = None, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of checkpoint ``tag`` (default: latest) as a full tensor, in model order
    (a checkpoint DeepSpeed wrote too: deepspeed_load.py)."""
    ds = deepspeed_load.find(checkpoint_dir, tag)
    if ds is not None:
        return deepspeed_load.consolidate(ds, parse_dtype(dtype))
    manifest = resolve_tag(checkpoint_dir, tag)
    reader = ArrayReader(manifest, progress=progress)
    kind = weight_kind(manifest)
    return _read_params(reader, kind, list(manifest.index), parse_dtype(dtype), f"read {manifest.tag}")


def _file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_config(out: Path, hf_config: dict | None, dtype: torch.dtype | None) -> list[Path]:
    if not hf_config:
        return []
    cfg = dict(hf_config)
    if dtype is not None:
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = str(dtype).removeprefix("torch.")
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return [out / "config.json"]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor of a safetensors file, before its values exist."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def safetensors_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None
                       ) -> tuple[bytes, list[TensorSpec]]:
    """The 8-byte length + JSON header of a file holding ``specs``, and the order their bytes
    follow it in: ``safetensors.torch.save_file``'s (by name within one dtype; compact JSON,
    ``__metadata__`` first, padded with spaces to 8 bytes), so a streamed file is byte for
    byte the one save_file writes from the same tensors."""
    dtypes = {s.dtype for s in specs}
    if len(dtypes) > 1:  # save_file orders mixed dtypes by its own enum; we never write them
        raise CheckpointError(f"a streamed safetensors file holds one dtype, got {sorted(map(str, dtypes))}")
    for s in specs:
        if s.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {s.name!r}: dtype {s.dtype} has no safetensors name here")
    order = sorted(specs, key=lambda s: s.name)
    doc: dict = {"__metadata__": metadata} if metadata else {}
    at = 0
    for s in order:
        doc[s.name] = {"dtype": _ST_DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
        at += s.nbytes
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head, order


class SafetensorsStream:
    """A safetensors file written in pieces: the header first, then tensor values appended
    (``append``) in ``order``, or at any tensor's element after ``seek`` (an export that walks
    its source in another order), so no tensor need be whole in memory.

    The file is written under a temporary name beside ``path`` (``.NAME.partial``) and renamed
    to ``path`` by ``close`` once every byte the header promises is written; ``abort`` (or a
    failed close) removes it, so an interrupted export never leaves a half-good file under the
    final name."""

    def __init__(self, path: str | os.PathLike, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        head, self.order = safetensors_header(specs, metadata)
        self._f = PartialFile(path)
        self.path, self.tmp = self._f.path, self._f.tmp
        self.expected = sum(s.nbytes for s in specs)
        self.written = 0
        self._starts, at = {}, len(head)
        for s in self.order:
            self._starts[s.name] = (at, s)
            at += s.nbytes
        self._pos, self._end = len(head), at  # next write; end of the run it may fill
        self._f.write(head)

    def seek(self, name: str, element: int) -> None:
        """Make the next ``append`` write tensor ``name``'s values from ``element`` on (up to
        that tensor's end)."""
        try:
            start, spec = self._starts[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None
        if not 0 <= element <= spec.numel:
            raise CheckpointError(f"{self.path}: element {element} is outside tensor {name!r} of {spec.numel}")
        self._pos, self._end = start + element * spec.dtype.itemsize, start + spec.nbytes
        self._f.seek(self._pos)

    def append(self, values: torch.Tensor) -> None:
        data = values.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        if self.written + data.nbytes > self.expected:
            raise CheckpointError(f"{self.path}: {self.written + data.nbytes} bytes of tensor data, "
                                  f"the header holds {self.expected}")
        if self._pos + data.nbytes > self._end:
            raise CheckpointError(f"{self.path}: a {data.nbytes}-byte piece at byte {self._pos} runs past "
                                  f"byte {self._end}, where the tensor it was sought to ends")
        self._f.write(data)
        self._pos += data.nbytes
        self.written += data.nbytes

    def close(self) -> None:
        """Rename the finished file into place (a CheckpointError, and no file, if short)."""
        if self.written != self.expected:
            self.abort()
            raise CheckpointError(f"{self.path}: {self.written} bytes of tensor data written, "
                                  f"the header holds {self.expected}")
        self._f.commit()

    def abort(self) -> None:
        """Close and remove the partial file (idempotent)."""
        self._f.abort()


Fill = Callable[[TensorSpec, int, int], torch.Tensor | None]
"""fill(spec, lo, n): elements [lo, lo + n) of tensor ``spec`` (flat, its dtype); None on a
process that does not write (the collective 16-bit export's other ranks)."""


def stream_shards(out: Path, shards: list[list[TensorSpec]], fill: Fill, *, write: bool = True,
                  progress: bool = False, desc: str = "", window: int | None = None) -> list[Path]:
    """Write ``shards`` (one list of specs per file) by pieces of at most ``window`` elements.

    ``fill`` is called in the same order on every process (file, tensor in file order,
    piece), so it may be collective; only a process with ``write`` touches ``out``."""
    window = window or STREAM_WINDOW
    names = _file_names(len(shards))
    total = sum(s.nbytes for shard in shards for s in shard)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not (progress and write))
    weight_map, written = {}, []
    for fname, shard in zip(names, shards, strict=True):
        stream = SafetensorsStream(out / fname, shard, {"format": "pt"}) if write else None
        try:
            for spec in (stream.order if stream else safetensors_header(shard)[1]):
                for lo in range(0, spec.numel, window):
                    n = min(window, spec.numel - lo)
                    values = fill(spec, lo, n)
                    if stream is not None:
                        stream.append(values)
                        bar.update(n * spec.dtype.itemsize)
        except BaseException:
            if stream is not None:
                stream.abort()
            raise
        if stream is not None:
            stream.close()
            written.append(stream.path)
        weight_map.update({s.name: fname for s in shard})
    bar.close()
    if write and len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.append(out / "model.safetensors.index.json")
    return written


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Model-order runs of ``specs`` of at most ``max_shard_bytes`` each (a larger tensor alone)."""
    shards, cur, size = [], [], 0
    for spec in specs:
        if cur and size + spec.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += spec.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def write_folder(tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike, *, hf_config: dict | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> list[Path]:
    """Write in-memory full tensors as a safetensors folder (sharded + index when large),
    replacing an earlier export in it ([Note: replacing an export] in zeroio/io/export_dir.py)."""
    specs = [TensorSpec(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]
    flat = {n: t.detach().reshape(-1) for n, t in tensors.items()}
    with ExportFolder(out_dir) as stage:
        written = stream_shards(stage.path, plan_shards(specs, max_shard_bytes),
                                lambda spec, lo, n: flat[spec.name].narrow(0, lo, n),
                                progress=progress, desc="save 16-bit model")
        dtype = specs[0].dtype if specs else None
        written += _write_config(stage.path, hf_config, dtype)
        stage.publish()
    return [stage.out / p.name for p in written]


def write_safetensors(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None = None, *,
                      dtype: str | torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True,
                      read_ahead: int | None = None) -> list[Path]:
    """Write checkpoint ``tag`` as a safetensors folder (+ index when sharded, + HF config.json).

    [Note: export order] save_file orders a file's tensors by name (layers.10 before
    layers.2), the checkpoint by model order, so a walk in file order would read a chunk
    again each time the names jump back. The export walks the checkpoint instead: each
    chunk is read and verified once, front to back, ``read_ahead`` chunks ahead of the
    writer ([Note: read-ahead bound] in reader.py, default ``READ_AHEAD``), and each tensor's
    part of it is cast and written at its place in its file (``SafetensorsStream.seek``) in
    pieces of at most ``STREAM_WINDOW`` elements. Host memory: ``read_ahead + 1`` chunks +
    one window and its cast. Every file is renamed into place only when complete, and
    nothing is renamed when a chunk is corrupt or missing: the CheckpointError names it. The
    folder is written beside ``out_dir`` and replaces an earlier export there whole
    ([Note: replacing an export] in zeroio/io/export_dir.py). A checkpoint DeepSpeed wrote is
    consolidated in memory (deepspeed_load.py), as DeepSpeed's zero_to_fp32 does."""
    ds = deepspeed_load.find(checkpoint_dir, tag)
    if ds is not None:
        return write_folder(deepspeed_load.consolidate(ds, parse_dtype(dtype)), out_dir,
                            max_shard_bytes=max_shard_bytes, progress=progress)
    manifest = resolve_tag(checkpoint_dir, tag)
    kind = weight_kind(manifest)
    info = manifest.arrays[kind]
    if info.extents:  # zeroio shares only optimizer moments (checkpoint/shared.py)
        raise CheckpointError(f"checkpoint {manifest.path}: weights array {kind!r} is stored as "
                              "extents, which the streamed export does not walk; use consolidate()")
    dt = parse_dtype(dtype) or info.dtype
    with ExportFolder(out_dir) as stage:
        written = _stream_checkpoint(manifest, kind, stage.path, dt, max_shard_bytes, progress, read_ahead)
        written += _write_config(stage.path, manifest.meta.get("hf_config"), dt)
        stage.publish()
    return [stage.out / p.name for p in written]


def _stream_checkpoint(manifest: Manifest, kind: str, out: Path, dt: torch.dtype, max_shard_bytes: int,
                       progress: bool, read_ahead: int | None) -> list[Path]:
    """The safetensors files (and index) of ``write_safetensors``, written into ``out``."""
    info = manifest.arrays[kind]
    idx = manifest.index
    specs = [TensorSpec(name=n, shape=tuple(e.shape), dtype=dt) for n, e in idx.items()]
    shards = plan_shards(specs, max_shard_bytes)
    names = _file_names(len(shards))
    window, ce = STREAM_WINDOW, info.chunk_elems
    # tensors in checkpoint order, and the chunks they cover, each once
    runs = sorted((idx[s.name].offset, s.numel, s.name) for s in specs if s.numel)
    chunks = sorted({c for off, n, _ in runs for c in range(off // ce, -(-(off + n) // ce))})
    total = sum(s.nbytes for s in specs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"consolidate {manifest.tag}", disable=not progress)
    streams: list[SafetensorsStream] = []
    try:
        for fname, shard in zip(names, shards, strict=True):
            streams.append(SafetensorsStream(out / fname, shard, {"format": "pt"}))
        file_of = {s.name: st for st in streams for s in st.order}
        with ChunkCursor(ArrayReader(manifest), kind, chunks, depth=read_ahead or READ_AHEAD) as cursor:
            first = 0  # the first run that may still overlap the current chunk
            for c, data in cursor:
                base, end = c * ce, (c + 1) * ce
                while first < len(runs) and runs[first][0] + runs[first][1] <= base:
                    first += 1
                r = first
                while r < len(runs) and runs[r][0] < end:
                    off, n, name = runs[r]
                    lo, hi = max(off, base), min(off + n, end)
                    stream = file_of[name]
                    stream.seek(name, lo - off)
                    for a in range(lo, hi, window):
                        b = min(hi, a + window)
                        stream.append(data[a - base: b - base].to(dt))
                    bar.update((hi - lo) * dt.itemsize)
                    r += 1
                del data  # [Note: read-ahead bound]: the held chunk is one of depth + 1
        for st in sorted(streams, key=lambda st: st.written == st.expected):
            st.close()  # a short file first: it raises before any file is renamed into place
    except BaseException:
        for st in streams:
            st.abort()
        raise
    finally:
        bar.close()
    written = [st.path for st in streams]
    if len(shards) > 1:
        weight_map = {s.name: fname for fname, shard in zip(names, shards, strict=True) for s in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.append(out / "model.safetensors.index.json")
    return written
