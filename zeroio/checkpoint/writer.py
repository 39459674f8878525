"""Saving a `ShardedState`: every rank writes its pieces, rank 0 commits a manifest.

Phases (see [Note: atomic tags] in layout.py and [Note: piece crcs] in crc.py):
1. rank 0 lays out the tag: group and array metadata, padded last chunks;
2. every rank writes its segments into the chunk files (concurrently, each to
   its own byte ranges), fsyncs them, optionally reads them back against the
   crcs taken from memory, and renames a done marker listing its pieces;
3. rank 0 checks that the pieces tile every chunk, combines their crcs into
   chunk crcs, renames manifest.json into place, then `latest`.
Every phase ends in `Comm.all_ok`, so one failing rank fails the save on all.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from concurrent.futures import as_completed
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from zeroio.checkpoint import layout
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.crc import combine, crc32c, zeros_crc
from zeroio.checkpoint.state import ShardedState
from zeroio.checkpoint.storage import (
    FileIO,
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    fsync_file,
    pread_exact,
    pwrite_all,
    read_json,
    set_size,
)
from zeroio.errors import CheckpointError


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a checkpoint is written."""

    chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES
    """Bytes per zarr chunk (rounded down to whole elements). Large chunks, few files."""
    threads: int = 4
    """Concurrent writes per rank."""
    verify: bool = True
    """Read every written piece back and compare its crc32c with the one taken from memory."""
    set_latest: bool = True
    """Point `latest` at this tag once it is committed."""
    progress: bool = True
    """A tqdm bar on rank 0."""


@dataclass(frozen=True)
class _Piece:
    kind: str
    chunk: int
    start: int  # byte offset inside the chunk
    nbytes: int
    crc: int


def _kind_dtypes(state: ShardedState) -> dict[str, torch.dtype]:
    dtypes = dict(state.meta.get("_dtypes", {}))
    for kind, segs in state.arrays.items():
        layout.check_name(kind, "array kind")
        for s in segs:
            d = dtypes.setdefault(kind, s.tensor.dtype)
            if s.tensor.dtype != d:
                raise CheckpointError(
                    f"array {kind!r}: segment at {s.offset} is {s.tensor.dtype}, others are {d}"
                )
        if kind not in dtypes:
            raise CheckpointError(f"array {kind!r} has no segments on this rank and no dtype")
    return dtypes


def _layout_tag(tdir: Path, numel: int, dtypes: dict[str, torch.dtype], chunk_elems: dict[str, int]) -> None:
    if tdir.exists():
        # unpublish first: a reader must never see the old manifest beside new chunks
        man = tdir / layout.MANIFEST
        if man.exists():
            man.unlink()
            fsync_dir(tdir)
        shutil.rmtree(tdir)
    tdir.mkdir(parents=True)
    atomic_write_json(tdir / "zarr.json", layout.group_metadata())
    (tdir / layout.DONE_DIR).mkdir()
    for kind, dtype in dtypes.items():
        (tdir / kind / "c").mkdir(parents=True)
        atomic_write_json(tdir / kind / "zarr.json", layout.array_metadata(numel, dtype, chunk_elems[kind]))
        n_chunks = -(-numel // chunk_elems[kind])
        if n_chunks:
            set_size(layout.chunk_path(tdir, kind, n_chunks - 1), chunk_elems[kind] * dtype.itemsize)


def _write_piece(path: Path, piece: torch.Tensor, byte_offset: int) -> int:
    """Copy a piece to host if needed, write it, return the crc32c of the bytes meant."""
    host = piece.detach().to("cpu").contiguous()
    crc = crc32c(host)
    pwrite_all(path, host.view(torch.uint8).numpy(), byte_offset)
    return crc


def _verify_piece(path: Path, start: int, nbytes: int, crc: int) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pread_exact(path, buf.numpy(), start)
    got = crc32c(buf)
    if got != crc:
        raise CheckpointError(
            f"read-back of {path} bytes [{start}, {start + nbytes}) has crc32c {got:#010x}, "
            f"wrote {crc:#010x}: the storage did not keep what was written"
        )


def _write_rank(state, tdir, dtypes, chunk_elems, opts, comm) -> list[_Piece]:
    jobs = []  # (kind, chunk, path, tensor piece, byte offset in chunk)
    for kind, segs in state.arrays.items():
        ce, isz = chunk_elems[kind], dtypes[kind].itemsize
        for seg in segs:
            t = seg.tensor.reshape(-1)
            g = seg.offset
            while g < seg.end:
                chunk = g // ce
                hi = min(seg.end, (chunk + 1) * ce)
                jobs.append((kind, chunk, layout.chunk_path(tdir, kind, chunk),
                             t[g - seg.offset: hi - seg.offset], (g - chunk * ce) * isz))
                g = hi
    total = sum(j[3].numel() * j[3].element_size() for j in jobs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"save {tdir.name}",
               disable=not (opts.progress and comm.rank == 0), leave=False)
    pieces: list[_Piece] = []
    with FileIO(opts.threads) as io:
        futs = {io.submit(_write_piece, path, t, off): (kind, chunk, off, t)
                for kind, chunk, path, t, off in jobs}
        for f in as_completed(futs):
            kind, chunk, off, t = futs[f]
            nbytes = t.numel() * t.element_size()
            pieces.append(_Piece(kind, chunk, off, nbytes, f.result()))
            bar.update(nbytes)
        files = sorted({layout.chunk_path(tdir, p.kind, p.chunk) for p in pieces})
        for f in [io.submit(fsync_file, p) for p in files]:
            f.result()
        if opts.verify:
            for f in [io.submit(_verify_piece, layout.chunk_path(tdir, p.kind, p.chunk), p.start, p.nbytes, p.crc)
                      for p in pieces]:
                f.result()
    bar.close()
    return pieces


def _chunk_crcs(tdir: Path, kind: str, numel: int, dtype: torch.dtype, ce: int, pieces) -> list[int]:
    isz = dtype.itemsize
    by_chunk = defaultdict(list)
    for p in pieces:
        by_chunk[p[0]].append(p)
    crcs = []
    for i in range(-(-numel // ce)):
        valid = min(ce, numel - i * ce) * isz
        pos, crc = 0, 0
        for _chunk, start, nbytes, pcrc in sorted(by_chunk.get(i, []), key=lambda p: p[1]):
            if start != pos:
                break
            crc = combine(crc, pcrc, nbytes) if pos else pcrc
            pos += nbytes
        if pos != valid:
            raise CheckpointError(
                f"{layout.chunk_path(tdir, kind, i)}: bytes from {pos} to {valid} were written by "
                f"no rank (or twice); the ranks' segments of {kind!r} do not tile the model"
            )
        pad = ce * isz - valid
        if pad:
            crc = combine(crc, zeros_crc(pad), pad)
        crcs.append(crc)
    return crcs


def _commit(state, tdir, tag, dtypes, chunk_elems, comm, opts, root) -> None:
    done = []
    for r in range(comm.world_size):
        d = read_json(tdir / layout.DONE_DIR / f"rank-{r:05d}.json", f"done marker of rank {r}")
        done.append(d)
    arrays = {}
    for kind, dtype in dtypes.items():
        pieces = [tuple(p) for d in done for p in d["pieces"].get(kind, [])]
        crcs = _chunk_crcs(tdir, kind, state.numel, dtype, chunk_elems[kind], pieces)
        arrays[kind] = layout.ArrayInfo(kind=kind, numel=state.numel, dtype=dtype,
                                        chunk_elems=chunk_elems[kind], chunk_crc32c=tuple(crcs))
    meta = {k: v for k, v in state.meta.items() if not k.startswith("_")}
    doc = layout.manifest_json(
        tag=tag, world_size=comm.world_size, index=state.index, arrays=arrays,
        scalars=state.scalars, rank_scalars=[d["rank_scalars"] for d in done],
        client_state=state.client_state, meta=meta, created_unix=time.time(),
    )
    atomic_write_json(tdir / layout.MANIFEST, doc)
    if opts.set_latest:
        atomic_write_text(Path(root) / layout.LATEST, tag + "\n")


def _phase(comm: Comm, fn, what: str):
    """Run ``fn`` (on this rank), then agree across ranks; any failure fails all."""
    err = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
        err = e
    if not comm.all_ok(err is None):
        if err is not None:
            raise err
        raise CheckpointError(f"checkpoint save failed on another rank while {what}; see its error")
    return result


def save_sharded(state: ShardedState, save_dir: str | os.PathLike, tag: str, *,
                 comm: Comm | None = None, options: SaveOptions = SaveOptions()) -> Path:
    """Write ``state`` (this rank's part) as checkpoint ``tag`` of ``save_dir``; returns the tag dir.

    Collective: every rank of ``comm`` calls it with its own segments.
    """
    comm = comm or Comm.default()
    tdir = layout.tag_dir(save_dir, tag)
    state.validate()
    dtypes = _kind_dtypes(state)
    chunk_elems = {k: max(1, options.chunk_bytes // d.itemsize) for k, d in dtypes.items()}

    def lay_out():
        if comm.rank == 0:
            _layout_tag(tdir, state.numel, dtypes, chunk_elems)

    _phase(comm, lay_out, f"laying out {tdir}")

    def write():
        pieces = _write_rank(state, tdir, dtypes, chunk_elems, options, comm)
        by_kind = defaultdict(list)
        for p in sorted(pieces, key=lambda p: (p.kind, p.chunk, p.start)):
            by_kind[p.kind].append([p.chunk, p.start, p.nbytes, p.crc])
        atomic_write_json(tdir / layout.DONE_DIR / f"rank-{comm.rank:05d}.json", {
            "rank": comm.rank, "world_size": comm.world_size,
            "pieces": dict(by_kind), "rank_scalars": state.rank_scalars,
        })

    _phase(comm, write, f"writing {tdir}")

    def commit():
        if comm.rank == 0:
            _commit(state, tdir, tag, dtypes, chunk_elems, comm, options, save_dir)

    _phase(comm, commit, f"committing {tdir / layout.MANIFEST}")
    return tdir
