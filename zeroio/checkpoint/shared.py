"""Arrays stored as extents: NVMe swap files shared with a checkpoint instead of copied.

[Note: shared extents] With ``offload_optimizer.device: nvme`` the Adam
moments already lie on disk, in the swap store's chunk files: a piece of a
rank's local shard each, its bytes followed by their crc32c. A chunked
checkpoint array would have to read them all and write them again (tens of
GB at 15-20B parameters). Instead, such a kind is stored as *extents*
(manifest format 3): each swap file gets a name in the tag,
``<kind>/x/r<rank>-<n>``, by reflink, hard link or, across file systems, a
kernel copy (zeroio/io/links.py, cheapest first), and the manifest lists
per extent its file, the bytes its crc covers, the crc (read from the swap
file's tail under the file's lock, so it is the crc of the bytes beside it)
and its spans: (element in the file, global offset, elements) runs of the
global flat order ([Note: global flat order] in state.py). Any world size
reads any range from the spans, as from chunks. Elements of the kind that
are in no swap file (frozen parameters' zero moments, rank 0) are written
as extent files of their own. Before the files are shared the optimizer
writes its dirty pieces (``flush_swap``): each dirty moment is written once,
to its swap file, and that file is shared; nothing else is written.

What keeps it correct:
- the swap store never writes in place over a file with a second link
  ([Note: shared chunk files] in zeroio/io/store.py): the checkpoint's bytes
  stay those of the save, whatever training does next;
- a name is only a name: removing the swap folder (``close``, a crashed
  run's cleanup) or an old checkpoint unlinks names, never the other's;
- every extent is read against its manifest crc on load, verify and
  ``inspect --verify``, like a chunk; a tag is still visible only once its
  manifest is renamed into place, and a failed save removes only the names it
  made ([Note: deleting only what zeroio wrote] in tags.py);
- shared files are fsynced (the swap store does not fsync); copies are read
  back against the crc when ``verify`` is on. Links are not read back: they
  wrote no data, and the load's crc check covers the media as for chunks.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from zeroio.checkpoint import layout
from zeroio.checkpoint.state import LazySegment, ShardedState
from zeroio.errors import CheckpointError
from zeroio.io.crc import crc32c
from zeroio.io.files import create_file, fsync_dir, fsync_file, pread_exact, pwrite_all, read_chunk
from zeroio.io.links import MODES, share_file

REPORT_KEYS = ("files_reflinked", "files_hardlinked", "files_copied", "bytes_shared", "bytes_copied",
               "bytes_flushed", "bytes_written")
"""Counts of a save ([Note: shared extents]): files shared each way; ``bytes_shared`` (sizes of
the reflinked / hard-linked files: nothing written), ``bytes_copied`` (of the copied ones),
``bytes_flushed`` (dirty swap pieces written to their files first) and ``bytes_written``
(every byte the save wrote: chunks, extent files, copies and the flush)."""


def empty_report() -> dict:
    return {k: 0 for k in REPORT_KEYS} | {"fallback": None}


def share_rank(state: ShardedState, tdir: Path, rank: int, *, verify: bool = True,
               modes: tuple[str, ...] = MODES) -> tuple[dict[str, list], dict]:
    """This rank's extents of every shared kind, made in ``tdir``: the shared files, then its
    segments of those kinds written as files. Returns (kind -> extent JSON, report)."""
    report = empty_report()
    out: dict[str, list] = {}
    for kind, files in state.shared.items():
        exts, i = [], 0
        for f in files:
            dst = layout.extent_path(tdir, kind, layout.extent_name(rank, i))
            done = share_file(f.path, dst, nbytes=f.nbytes, crc_at=f.crc_at, modes=modes)
            modes = modes[modes.index(done.mode):]  # what failed once fails for the rest
            if done.mode == "copy" and report["fallback"] is None:
                report["fallback"] = done.reason
            report[f"files_{done.mode}ed" if done.mode != "copy" else "files_copied"] += 1
            if done.mode == "copy":
                report["bytes_copied"] += done.nbytes
                report["bytes_written"] += done.nbytes
                if verify:
                    _check_copy(dst, f.crc_at, done.crc32c)
            else:
                report["bytes_shared"] += done.nbytes
            exts.append(layout.Extent(file=dst.name, crc_bytes=f.crc_at, crc32c=done.crc32c,
                                      spans=f.spans).to_json())
            i += 1
        for seg in state.arrays.get(kind, []):
            dst = layout.extent_path(tdir, kind, layout.extent_name(rank, i))
            crc, nbytes = _write_segment(dst, seg, verify)
            report["bytes_written"] += nbytes
            exts.append(layout.Extent(file=dst.name, crc_bytes=nbytes, crc32c=crc,
                                      spans=((0, seg.offset, _numel(seg)),)).to_json())
            i += 1
        if i:
            fsync_dir(tdir / kind / layout.EXTENTS_DIR)
        out[kind] = exts
    if report["files_copied"]:
        warnings.warn(f"checkpoint {tdir.name}: {report['files_copied']} swap file(s) "
                      f"({report['bytes_copied']} bytes) were copied, not linked ({report['fallback']})",
                      layout.CheckpointWarning, stacklevel=3)
    return out, report


def _numel(seg) -> int:
    return seg.numel if isinstance(seg, LazySegment) else seg.tensor.numel()


def _write_segment(dst: Path, seg, verify: bool) -> tuple[int, int]:
    host = (seg.read(0, seg.numel) if isinstance(seg, LazySegment) else seg.tensor).detach().to("cpu")
    raw = host.contiguous().reshape(-1).view(torch.uint8)
    crc = crc32c(raw)
    create_file(dst)
    pwrite_all(dst, raw.numpy(), 0)
    fsync_file(dst)
    if verify:
        _check_copy(dst, raw.numel(), crc)
    return crc, raw.numel()


def _check_copy(path: Path, nbytes: int, crc: int) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pread_exact(path, buf.numpy(), 0)
    got = crc32c(buf)
    if got != crc:
        raise CheckpointError(f"read-back of {path} has crc32c {got:#010x}, expected {crc:#010x}: the "
                              "storage did not keep what was written")


def merge_reports(reports: list[dict]) -> dict:
    """The ranks' reports summed (``fallback``: the first rank's reason, if any)."""
    out = empty_report()
    for r in reports:
        for k in REPORT_KEYS:
            out[k] += int(r.get(k, 0))
        if out["fallback"] is None and r.get("fallback"):
            out["fallback"] = r["fallback"]
    return out


def array_info(kind: str, numel: int, dtype: torch.dtype, extents: list, where) -> layout.ArrayInfo:
    """The manifest entry of a shared kind from the ranks' extents (rank 0, at commit)."""
    exts = tuple(layout.Extent(file=e[0], crc_bytes=e[1], crc32c=e[2],
                               spans=tuple(tuple(s) for s in e[3])) for e in extents)
    layout.check_tiling(kind, exts, numel, where)
    return layout.ArrayInfo(kind=kind, numel=numel, dtype=dtype, chunk_elems=1, chunk_crc32c=(),
                            extents=exts)


def read_extent(engine, manifest: layout.Manifest, info: layout.ArrayInfo, i: int) -> torch.Tensor:
    """Extent ``i`` of ``info``: its checked bytes, crc-verified, as elements of the dtype."""
    e = info.extents[i]
    path = layout.extent_path(manifest.tag_dir, info.kind, e.file)
    buf = read_chunk(engine, path, e.crc_bytes)
    got = crc32c(buf)
    if got != e.crc32c:
        raise CheckpointError(
            f"checkpoint file {path} (array {info.kind!r}, extent {e.file}) is corrupt: crc32c "
            f"{got:#010x}, manifest {manifest.path} recorded {e.crc32c:#010x}; restore the file or "
            "load another tag")
    usable = e.crc_bytes // info.itemsize * info.itemsize
    return buf[:usable].view(info.dtype)

