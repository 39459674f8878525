"""Saving a `ShardedState`: every rank writes its pieces, rank 0 commits a manifest.

Phases (see [Note: atomic tags] in layout.py, [Note: re-saving a tag] in tags.py and
[Note: piece crcs] in zeroio/io/crc.py; every file access goes through zeroio/io/files.py):
1. rank 0 finishes or removes what a crashed save left beside the tag, then lays
   out the staging folder: group metadata (zeroio's marker) first, array
   metadata, chunk files (the last one padded);
2. every rank writes its segments into the chunk files (concurrently, each to
   its own byte ranges, the arrays interleaved), taking each piece's crc32c from
   the bytes handed to the write; as soon as its last piece of a file is in,
   fsyncs that file and reads its pieces back against those crcs (beside the
   remaining writes; [Note: what verify proves]); renames a done marker;
3. rank 0 checks that the pieces tile every chunk, combines their crcs into
   chunk crcs, renames manifest.json into place, makes the staging folder the tag
   (rename, or an atomic exchange with the old copy), writes `latest`, and removes
   the old copy.
Every phase ends in `Comm.all_ok`, so one failing rank fails the save on all; a
failed save leaves the tag (old copy) and `latest` as they were.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from collections import defaultdict
from concurrent.futures import as_completed
from dataclasses import dataclass, replace
from functools import partial
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm import tqdm

from zeroio.checkpoint import layout, shared, tags
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.state import LazySegment, ShardedState, segment_dtype
from zeroio.errors import CheckpointError, SwapIOError
from zeroio.io.crc import combine, crc32c, zeros_crc
from zeroio.io.files import (
    FileIO,
    FileIOSettings,
    atomic_write_json,
    atomic_write_text,
    create_file,
    fsync_file,
    open_engine,
    pread_exact,
    pwrite_all,
    read_json,
    set_size,
)
from zeroio.io.links import same_device


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a checkpoint is written."""

    chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES
    """Bytes per zarr chunk (rounded down to whole elements). Large chunks, few files."""
    threads: int = 4
    """Concurrent writes per rank."""
    aio: object | None = None
    """The config's ``aio`` block (or an ``EngineSettings``): one that differs from DeepSpeed's
    defaults sets the write threads (its ``thread_count``, instead of ``threads``) and the
    engine's block_size / queue_depth ([Note: pool settings] in zeroio/io/files.py)."""
    verify: bool = True
    """Read every written piece back and compare its crc32c with the one taken at write time
    ([Note: what verify proves])."""
    direct: bool = False
    """Write through the io layer's engine: O_DIRECT for each piece's 4096-aligned body (no
    page-cache copy, nothing dirty left for fsync), buffered for unaligned edges. The
    read-back verify then reads those bytes from the device: a media check, at the cost of
    reading the checkpoint once from disk."""
    set_latest: bool = True
    """Point `latest` at this tag once it is committed."""
    progress: bool = True
    """A tqdm bar on rank 0."""
    share_swap: bool = True
    """Share NVMe-resident optimizer state's swap files with the checkpoint instead of copying
    them through host memory (engine saves; [Note: shared extents] in shared.py)."""
    share_modes: tuple[str, ...] = ("reflink", "hardlink", "copy")
    """How files a state hands over by name (``ShardedState.shared``: NVMe swap files) get
    into the tag, cheapest first ([Note: shared extents] in shared.py)."""


@dataclass(frozen=True)
class _Piece:
    kind: str
    chunk: int
    start: int  # byte offset inside the chunk
    nbytes: int
    crc: int


def _kind_dtypes(state: ShardedState) -> dict[str, torch.dtype]:
    dtypes = dict(state.meta.get("_dtypes", {}))
    for kind in state.shared:
        state.arrays.setdefault(kind, [])
    for kind, segs in state.arrays.items():
        layout.check_name(kind, "array kind")
        for s in segs:
            d = dtypes.setdefault(kind, segment_dtype(s))
            if segment_dtype(s) != d:
                raise CheckpointError(
                    f"array {kind!r}: segment at {s.offset} is {segment_dtype(s)}, others are {d}"
                )
        if kind not in dtypes:
            raise CheckpointError(f"array {kind!r} has no segments on this rank and no dtype")
    return dtypes


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest existing ancestor: where a folder still to be made will live."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def chunk_elems_for(dtypes: dict[str, torch.dtype], chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES
                    ) -> dict[str, int]:
    """Elements per chunk of each kind: ``chunk_bytes`` rounded down to whole elements."""
    return {k: max(1, chunk_bytes // d.itemsize) for k, d in dtypes.items()}


def checkpoint_bytes(numel: int, dtypes: dict[str, torch.dtype],
                     chunk_elems: dict[str, int] | None = None) -> int:
    """Bytes of a checkpoint's arrays on disk: every kind's chunks, uncompressed, the last one
    padded whole (``set_size``), so ``ceil(numel / chunk) * chunk * itemsize`` per kind. The
    JSON metadata (manifest, zarr.json, done markers) is not counted: kilobytes."""
    chunk_elems = chunk_elems or chunk_elems_for(dtypes)
    return sum(-(-numel // chunk_elems[k]) * chunk_elems[k] * d.itemsize
               for k, d in dtypes.items())


def check_disk_space(tdir: Path, numel: int, dtypes: dict[str, torch.dtype],
                     chunk_elems: dict[str, int], *, extra: int = 0) -> None:
    """Raise before anything is touched when the file system holding ``tdir`` cannot take the
    checkpoint (``checkpoint_bytes``, plus ``extra``) against its free bytes. An old copy of the same tag is not counted: it stays
    until the new one is complete ([Note: re-saving a tag])."""
    need = checkpoint_bytes(numel, dtypes, chunk_elems) + extra
    probe = existing_parent(tdir)
    free = shutil.disk_usage(probe).free
    if need > free:
        again = (f" (an existing {tdir.name!r} is kept until the new copy is complete, so it is "
                 "not counted: save under another tag, or remove it first)") if tdir.exists() else ""
        raise CheckpointError(
            f"checkpoint {tdir} needs {need / 1e9:.2f} GB ({', '.join(dtypes)}) but the file "
            f"system of {probe} has {free / 1e9:.2f} GB free{again}: free {(need - free) / 1e9:.2f} GB "
            "or save to another directory; nothing was written, earlier checkpoints are intact")


def _layout_tag(root: Path, tag: str, numel: int, dtypes: dict[str, torch.dtype],
                chunk_elems: dict[str, int], shared: dict[str, torch.dtype] | None = None,
                shared_need: int = 0) -> Path:
    """Rank 0: clear the way and lay out the staging folder of ``tag``; returns it. ``shared``:
    the kinds stored as extents (their folders only; ``shared_need``: the bytes their copies
    may need, counted against free space with the chunked kinds')."""
    final, stage = root / tag, tags.staging_dir(root, tag)
    tags.check_replaceable(final)
    if root.is_dir():
        tags.recover(root)  # what crashed saves left beside their tags
    if os.path.lexists(stage):
        raise CheckpointError(
            f"{stage} (where zeroio writes a new copy of {tag!r}) still holds files zeroio did not "
            "write; move them out of it and save again")
    check_disk_space(final, numel, dtypes, chunk_elems, extra=shared_need)
    root.mkdir(parents=True, exist_ok=True)
    stage.mkdir()
    atomic_write_json(stage / "zarr.json", layout.group_metadata())  # the marker, first
    (stage / layout.DONE_DIR).mkdir()
    for kind, dtype in (shared or {}).items():
        (stage / kind).mkdir()
        (stage / kind / layout.EXTENTS_DIR).mkdir()
        atomic_write_json(stage / kind / "zarr.json", layout.extents_metadata(dtype))
    for kind, dtype in dtypes.items():
        (stage / kind).mkdir()
        (stage / kind / "c").mkdir()
        atomic_write_json(stage / kind / "zarr.json", layout.array_metadata(numel, dtype, chunk_elems[kind]))
        n_chunks = -(-numel // chunk_elems[kind])
        for i in range(n_chunks - 1):  # created here, so each file's mode is the checkpoint's
            create_file(layout.chunk_path(stage, kind, i))
        if n_chunks:
            set_size(layout.chunk_path(stage, kind, n_chunks - 1), chunk_elems[kind] * dtype.itemsize)
    return stage


def _write_piece(path: Path, get, byte_offset: int, nbytes: int, engine=None) -> int:
    """Take the piece (a view, or a read of a `LazySegment`), write it, return its crc32c.

    The crc is one C call over the exact host bytes handed to ``pwrite``, so it is the
    crc of what was written, not of a later state of the tensor.
    """
    host = get().detach().to("cpu").contiguous()  # no copy for a contiguous host view
    got = host.numel() * host.element_size()
    if got != nbytes:
        raise CheckpointError(f"piece for {path} at byte {byte_offset}: the segment gave {got} bytes, "
                              f"{nbytes} were expected")
    crc = crc32c(host)
    if engine is None:
        pwrite_all(path, host.view(torch.uint8).numpy(), byte_offset)
    else:
        engine.write(path, host.reshape(-1).view(torch.uint8), byte_offset).result()
    return crc


def _sync_and_verify(path: Path, pieces: list[_Piece], verify: bool, engine=None) -> None:
    """fsync a chunk file once this rank's last piece of it is written, then read the pieces back.

    [Note: what verify proves] The read-back goes through the page cache, after the
    fsync: it proves that the file, at each piece's offsets, holds exactly the bytes
    whose crc32c goes into the manifest (no misdirected, short, torn or overlapping
    write, no other rank's bytes in our range), so every later load will pass its
    crc check as long as the device keeps what fsync acknowledged. It does not prove
    the media holds them (cached pages are served from memory); that is what the
    crc check on every load is for. Being a memory read, it runs beside the writes.
    With ``SaveOptions.direct`` the aligned bodies bypassed the cache both ways, so
    for them the read-back is a read of the device.
    """
    fsync_file(path)
    if not verify:
        return
    for p in pieces:
        buf = torch.empty(p.nbytes, dtype=torch.uint8)
        if engine is None:
            pread_exact(path, buf.numpy(), p.start)
        else:
            try:
                engine.read(path, buf, p.start).result()
            except SwapIOError as e:
                raise CheckpointError(f"reading back {path} failed: {e}") from e
        got = crc32c(buf)
        if got != p.crc:
            raise CheckpointError(
                f"read-back of {path} bytes [{p.start}, {p.start + p.nbytes}) has crc32c {got:#010x}, "
                f"wrote {p.crc:#010x}: the storage did not keep what was written"
            )


def _jobs(state: ShardedState, tdir: Path, dtypes, chunk_elems) -> list[tuple]:
    """(kind, chunk, path, get, byte offset in chunk, nbytes) of every piece, arrays interleaved
    so the pool writes several arrays (files) at once."""
    per_kind = []
    for kind, segs in state.arrays.items():
        ce, isz = chunk_elems[kind], dtypes[kind].itemsize
        jobs = []
        for seg in segs:
            g = seg.offset
            while g < seg.end:
                chunk = g // ce
                hi = min(seg.end, (chunk + 1) * ce)
                lo_l, hi_l = g - seg.offset, hi - seg.offset
                if isinstance(seg, LazySegment):
                    get = partial(seg.read, lo_l, hi_l - lo_l)
                else:
                    get = partial(_view, seg.tensor, lo_l, hi_l)
                jobs.append((kind, chunk, layout.chunk_path(tdir, kind, chunk), get,
                             (g - chunk * ce) * isz, (hi - g) * isz))
                g = hi
        per_kind.append(jobs)
    return [j for group in zip_longest(*per_kind) for j in group if j is not None]


def _view(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t.reshape(-1)[lo:hi]


def _write_rank(state, tdir, dtypes, chunk_elems, opts, comm) -> list[_Piece]:
    jobs = _jobs(state, tdir, dtypes, chunk_elems)
    left = defaultdict(int)  # this rank's unwritten pieces per chunk file
    for j in jobs:
        left[j[2]] += 1
    tag = tdir.name.removeprefix(tags.STAGING_PREFIX)
    bar = tqdm(total=sum(j[5] for j in jobs), unit="B", unit_scale=True, desc=f"save {tag}",
               disable=not (opts.progress and comm.rank == 0), leave=False)
    pieces: list[_Piece] = []
    by_file = defaultdict(list)
    checks = []
    # writes on one pool; each file's fsync + read-back on another, as soon as its last piece is in
    pool = FileIOSettings.from_aio(opts.aio, opts.threads)
    engine = open_engine(pool) if opts.direct else None
    try:
        with FileIO(pool.threads) as io, FileIO(max(1, pool.threads // 2)) as checker:
            futs = {io.submit(_write_piece, path, get, off, n, engine): (kind, chunk, path, off, n)
                    for kind, chunk, path, get, off, n in jobs}
            try:
                for f in as_completed(futs):
                    kind, chunk, path, off, n = futs[f]
                    p = _Piece(kind, chunk, off, n, f.result())
                    pieces.append(p)
                    by_file[path].append(p)
                    bar.update(n)
                    left[path] -= 1
                    if not left[path]:
                        checks.append(checker.submit(_sync_and_verify, path, by_file[path], opts.verify,
                                                     engine))
                for f in checks:
                    f.result()
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
    finally:  # after the pools have drained: no thread still uses the engine
        if engine is not None:
            engine.close()
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
        if kind in state.shared:
            extents = [e for d in done for e in d.get("extents", {}).get(kind, [])]
            arrays[kind] = shared.array_info(kind, state.numel, dtype, extents, tdir)
            continue
        pieces = [tuple(p) for d in done for p in d["pieces"].get(kind, [])]
        crcs = _chunk_crcs(tdir, kind, state.numel, dtype, chunk_elems[kind], pieces)
        arrays[kind] = layout.ArrayInfo(kind=kind, numel=state.numel, dtype=dtype,
                                        chunk_elems=chunk_elems[kind], chunk_crc32c=tuple(crcs))
    meta = {k: v for k, v in state.meta.items() if not k.startswith("_")}
    if state.shared:  # what sharing saved: [Note: shared extents] in shared.py
        meta["save"] = shared.merge_reports([d.get("share", {}) for d in done]) | {
            "full_copy_bytes": sum(state.numel * d.itemsize for d in dtypes.values())}
    doc = layout.manifest_json(
        tag=tag, world_size=comm.world_size, index=state.index, arrays=arrays,
        scalars=state.scalars, rank_scalars=[d["rank_scalars"] for d in done],
        client_state=state.client_state, meta=meta, created_unix=time.time(),
    )
    atomic_write_json(tdir / layout.MANIFEST, doc)
    old = tags.commit(tdir, Path(root) / tag)
    if opts.set_latest:
        atomic_write_text(Path(root) / layout.LATEST, tag + "\n")
    if old is not None:
        try:
            tags.discard(old)
        except (OSError, CheckpointError) as e:  # the new copy is committed; the next save retries
            warnings.warn(f"checkpoint {tag!r} is saved, but removing its previous copy {old} "
                          f"failed: {e}", layout.CheckpointWarning, stacklevel=2)


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

    Collective: every rank of ``comm`` calls it with its own segments. The tag is checked
    before anything is touched; the new copy is written beside the tag and swapped in only
    when complete ([Note: re-saving a tag]).
    """
    return save_sharded_report(state, save_dir, tag, comm=comm, options=options)[0]


def _shared_need(state: ShardedState, root: Path, dtypes) -> int:
    """Bytes the shared kinds need in the tag: none where the files can be linked (same file
    system as rank 0's), else their copies."""
    files = [f for fs in state.shared.values() for f in fs]
    if not files or same_device(files[0].path, existing_parent(root)):
        return 0
    return sum(state.numel * dtypes[k].itemsize for k in state.shared)


def save_sharded_report(state: ShardedState, save_dir: str | os.PathLike, tag: str, *,
                        comm: Comm | None = None, options: SaveOptions = SaveOptions()
                        ) -> tuple[Path, dict]:
    """``save_sharded``, and this rank's report of what it wrote and shared: the keys of
    ``shared.REPORT_KEYS`` (``bytes_written``: chunk and extent bytes this rank wrote) and
    ``fallback`` (why a cheaper way of sharing was not used, or None)."""
    comm = comm or Comm.default()
    tags.check_tag(tag)
    root = Path(save_dir)
    stage = tags.staging_dir(root, tag)
    state.validate()
    dtypes = _kind_dtypes(state)
    chunk_elems = chunk_elems_for(dtypes, options.chunk_bytes)
    chunked = {k: d for k, d in dtypes.items() if k not in state.shared}
    report = shared.empty_report()

    def lay_out():
        if comm.rank == 0:
            _layout_tag(root, tag, state.numel, chunked, chunk_elems,
                        {k: dtypes[k] for k in state.shared}, _shared_need(state, root, dtypes))

    def write():
        plain = replace(state, arrays={k: v for k, v in state.arrays.items() if k in chunked}, shared={})
        try:
            pieces = _write_rank(plain, stage, chunked, chunk_elems, options, comm)
            extents, done = shared.share_rank(state, stage, comm.rank, verify=options.verify,
                                              modes=options.share_modes)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SwapIOError(e.errno, f"saving checkpoint {tag!r} ran out of space: {e}. Nothing was "
                              f"committed: {root / tag} and `latest` are as they were; free space or "
                              "save to another directory") from e
        by_kind = defaultdict(list)
        for p in sorted(pieces, key=lambda p: (p.kind, p.chunk, p.start)):
            by_kind[p.kind].append([p.chunk, p.start, p.nbytes, p.crc])
        done["bytes_flushed"] = int(state.meta.get("_swap_flushed", 0))
        done["bytes_written"] += sum(p.nbytes for p in pieces) + done["bytes_flushed"]
        report.update(done)
        atomic_write_json(stage / layout.DONE_DIR / f"rank-{comm.rank:05d}.json", {
            "rank": comm.rank, "world_size": comm.world_size,
            "pieces": dict(by_kind), "rank_scalars": state.rank_scalars,
            **({"extents": extents, "share": done} if state.shared else {}),
        })

    def commit():
        if comm.rank == 0:
            _commit(state, stage, tag, dtypes, chunk_elems, comm, options, root)

    try:
        _phase(comm, lay_out, f"laying out {stage}")
        _phase(comm, write, f"writing {stage}")
        _phase(comm, commit, f"committing {root / tag}")
    except BaseException:
        if comm.rank == 0:  # every rank has stopped writing (each phase ends in all_ok)
            _clean_up(root, tag)
        raise
    return root / tag, report


def _clean_up(root: Path, tag: str) -> None:
    """After a failed save: remove the incomplete copy (the tag and `latest` are untouched)."""
    try:
        tags.recover(root, [tag])
    except (OSError, CheckpointError) as e:
        warnings.warn(f"the failed save of {tag!r} left {tags.staging_dir(root, tag)}; the next save "
                      f"removes it ({e})", layout.CheckpointWarning, stacklevel=3)
