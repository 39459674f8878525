"""Loading: find the tag, check the manifest against the model, read each rank's ranges.

Every chunk that is read is checked against the crc32c the manifest recorded
for it before any of its bytes are used, so a corrupted or truncated array is
a CheckpointError naming the chunk file, never silently wrong weights.
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from zeroio.checkpoint import layout, shared, tags
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.layout import CheckpointWarning
from zeroio.checkpoint.state import LazySegment, ParamEntry, ShardedState, split_by_param
from zeroio.errors import CheckpointError
from zeroio.io.crc import crc32c
from zeroio.io.files import FileIO, FileIOSettings, open_engine, read_chunk

__all__ = ["ArrayReader", "ChunkCursor", "CheckpointWarning", "LoadResult", "ShardedLoad", "load_sharded",
           "resolve_tag"]


def check_root(root: Path) -> None:
    """``root`` must be a checkpoint directory: not missing, not one tag's folder."""
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tags.is_tag_folder(root):
        raise CheckpointError(
            f"{root} is the folder of checkpoint tag {root.name!r}, not a checkpoint directory: pass "
            f"its parent {root.parent}, and --tag {root.name} (tag={root.name!r}) to pick this tag")


def resolve_tag(root: str | os.PathLike, tag: str | None = None, *, warn: bool = True) -> layout.Manifest:
    """The manifest of ``tag``, or of the newest complete tag when ``tag`` is None.

    With ``tag=None`` the tag named by `latest` is used; if it is incomplete,
    the newest complete tag is used with a warning naming the broken one.
    Incomplete tags are always reported (CheckpointWarning). An explicit tag
    that is missing or incomplete is a CheckpointError.
    """
    root = Path(root)
    check_root(root)
    scan = tags.scan_tags(root)
    complete = [t for t in scan if t.complete]
    broken = [t for t in scan if not t.complete]

    def report(skip: Iterable[tags.TagStatus]) -> None:
        if warn:
            for t in skip:
                warnings.warn(f"ignoring incomplete checkpoint {t.path}: {t.reason}", CheckpointWarning,
                              stacklevel=3)

    if tag is not None:
        tags.check_tag(tag)
        status = next((t for t in scan if t.tag == tag), None)
        if status is None:
            raise CheckpointError(
                f"checkpoint tag {tag!r} not found in {root}; complete tags: {[t.tag for t in complete]}"
            )
        if not status.complete:
            raise CheckpointError(f"checkpoint {status.path} is incomplete: {status.reason}; complete tags: "
                                  f"{[t.tag for t in complete]}")
        report(t for t in broken if t.created_unix > status.created_unix)
        return layout.read_manifest(status.path / layout.MANIFEST)

    latest = layout.read_latest(root)
    chosen = next((t for t in complete if t.tag == latest), None)
    if chosen is None:
        if not complete:
            detail = f"; incomplete: {[f'{t.tag} ({t.reason})' for t in broken]}" if broken else ""
            raise CheckpointError(f"no complete checkpoint in {root}{detail}")
        chosen = complete[-1]
        if warn:
            why = f"`latest` names {latest!r}, which is not a complete checkpoint" if latest else "no `latest` file"
            warnings.warn(f"{root}: {why}; loading the newest complete tag {chosen.tag!r}",
                          CheckpointWarning, stacklevel=2)
    report(t for t in broken if t.created_unix >= chosen.created_unix or t.tag == latest)
    return layout.read_manifest(chosen.path / layout.MANIFEST)


@dataclass(frozen=True)
class _Request:
    src: int  # element offset in the checkpoint array
    dest: torch.Tensor | None = None  # 1-D view to fill, or
    sink: Callable[[int, torch.Tensor], None] | None = None  # sink(offset in request, values)
    n: int = 0  # elements, with a sink

    @property
    def numel(self) -> int:
        return self.dest.numel() if self.dest is not None else self.n

    @property
    def end(self) -> int:
        return self.src + self.numel

    def put(self, lo: int, values: torch.Tensor) -> None:
        if self.dest is not None:
            self.dest[lo: lo + values.numel()].copy_(values)
        else:
            self.sink(lo, values)


def _shifted(write: Callable[[int, torch.Tensor], None], base: int, lo: int, values: torch.Tensor) -> None:
    write(base + lo, values)


class ArrayReader:
    """Verified range reads of one checkpoint's arrays.

    ``aio``: the config's ``aio`` block; one that differs from DeepSpeed's defaults sets the
    threads and the engine's request shape instead of ``threads`` ([Note: pool settings] in
    zeroio/io/files.py)."""

    def __init__(self, manifest: layout.Manifest, threads: int = 4, progress: bool = False, *,
                 aio: object | None = None):
        self.manifest = manifest
        self.io = FileIOSettings.from_aio(aio, threads)
        self.threads = self.io.threads
        self.progress = progress

    def info(self, kind: str) -> layout.ArrayInfo:
        try:
            return self.manifest.arrays[kind]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.manifest.path} has no array {kind!r}; it holds "
                f"{sorted(self.manifest.arrays)}"
            ) from None

    def _chunk(self, engine, info: layout.ArrayInfo, i: int) -> torch.Tensor:
        path = layout.chunk_path(self.manifest.tag_dir, info.kind, i)
        try:
            buf = read_chunk(engine, path, info.chunk_nbytes)
        except CheckpointError as e:
            raise CheckpointError(f"array {info.kind!r} chunk {i}: {e}") from None
        got, want = crc32c(buf), info.chunk_crc32c[i]
        if got != want:
            raise CheckpointError(
                f"checkpoint file {path} (array {info.kind!r}, chunk {i}) is corrupt: crc32c "
                f"{got:#010x}, manifest {self.manifest.path} recorded {want:#010x}; restore the file "
                "or load another tag"
            )
        return buf.view(info.dtype)

    def _unit(self, engine, info: layout.ArrayInfo, i: int) -> torch.Tensor:
        """Chunk ``i``, or extent ``i`` of an array stored as extents, verified."""
        if info.extents:
            return shared.read_extent(engine, self.manifest, info, i)
        return self._chunk(engine, info, i)

    def read_requests(self, kind: str, requests: list[_Request], desc: str = "") -> None:
        info = self.info(kind)
        for r in requests:
            if r.src < 0 or r.end > info.numel:
                raise CheckpointError(f"range [{r.src}, {r.end}) is outside array {kind!r} of {info.numel}")
        by_unit = _by_unit(info, requests)

        def one(c: int) -> int:
            data = self._unit(engine, info, c)
            for r, at, base, end in by_unit[c]:
                lo, hi = max(r.src, base), min(r.end, end)
                r.put(lo - r.src, data[at + lo - base: at + hi - base])
            return data.numel() * info.itemsize

        unit_bytes = info.chunk_nbytes if not info.extents else \
            max((e.crc_bytes for e in info.extents), default=0)
        bar = tqdm(total=len(by_unit) * unit_bytes, unit="B", unit_scale=True,
                   desc=desc or f"load {kind}", disable=not self.progress, leave=False)
        # chunks are verified and scattered on this pool; their bytes move on the engine's
        with FileIO(self.threads) as io, open_engine(self.io) as engine:
            for f in [io.submit(one, c) for c in sorted(by_unit)]:
                bar.update(f.result())
        bar.close()

    def verify(self, kind: str, chunks: Iterable[int] | None = None, *, depth: int = 2) -> int:
        """Read chunks of ``kind`` (default: all) and check each crc32c, writing nothing.
        Memory: ``depth + 1`` chunks ([Note: read-ahead bound]), whatever the array's size.
        Returns the number of chunks checked."""
        info = self.info(kind)
        order = range(info.num_chunks) if chunks is None else sorted(chunks)
        n = 0
        with ChunkCursor(self, kind, order, depth=depth) as cursor:
            for _c, data in cursor:
                del data
                n += 1
        return n

    def read(self, kind: str, offset: int = 0, numel: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [offset, offset + numel) of array ``kind`` (its stored dtype unless ``out``)."""
        info = self.info(kind)
        numel = info.numel - offset if numel is None else numel
        if out is None:
            out = torch.empty(numel, dtype=info.dtype)
        self.read_requests(kind, [_Request(offset, dest=out.view(-1))])
        return out


class ChunkCursor:
    """Verified chunks of one array in a given order, read ahead by a bounded pool (a streamed
    export walks the array front to back once, so each chunk is read exactly once).

    [Note: read-ahead bound] At most ``depth`` chunks are being read, or wait read and
    crc-checked, ahead of the one the consumer holds (or waits for): ``depth + 1`` chunk
    buffers (64 MB each by default) when the consumer drops each chunk before asking for the
    next. A read is submitted only when the consumer takes a chunk, so a slow consumer never
    lets reads run further ahead. A corrupt or missing chunk raises its CheckpointError
    when the consumer reaches it, in order; the reads still in flight are waited for on close.
    """

    def __init__(self, reader: ArrayReader, kind: str, chunks: Iterable[int], *, depth: int = 2):
        if depth < 1:
            raise CheckpointError(f"read-ahead depth must be >= 1, got {depth}")
        self.reader, self.info, self.depth = reader, reader.info(kind), depth
        self._chunks = list(chunks)
        n = self.info.num_chunks
        bad = [c for c in self._chunks if not 0 <= c < n]
        if bad:
            raise CheckpointError(f"chunk(s) {bad[:3]} outside array {kind!r} of {n} chunks")
        # one worker per chunk in flight; the engine splits each chunk over its own threads
        self._engine = open_engine(reader.io)
        self._pool = FileIO(depth)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(chunk index, its elements in the stored dtype), in the order given."""
        order = iter(self._chunks)
        pending: deque[tuple[int, Future]] = deque()

        def top_up() -> None:
            while len(pending) < self.depth and (c := next(order, None)) is not None:
                pending.append((c, self._pool.submit(self.reader._unit, self._engine, self.info, c)))

        try:
            top_up()
            while pending:
                c, fut = pending.popleft()
                top_up()  # keep `depth` reads going while this chunk is waited for and used
                data = fut.result()
                del fut  # a finished future keeps its result alive
                yield c, data
                del data
        finally:
            for _c, fut in pending:
                fut.cancel()

    def close(self) -> None:
        self._pool.close()
        self._engine.close()

    def __enter__(self) -> ChunkCursor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(kw_only=True)
class LoadResult:
    manifest: layout.Manifest
    path: Path
    tag: str
    scalars: dict[str, Any]
    rank_scalars: dict[str, Any]
    client_state: dict[str, Any]
    loaded_names: list[str]
    skipped_names: list[str] = field(default_factory=list)


def model_mismatch(missing: list[str], unexpected: list[str],
                   differ: tuple[int, str, tuple, tuple] | None) -> str:
    """How a checkpoint's parameters and a model's disagree, in one clause each: names the
    model has and the checkpoint lacks, the reverse, and ``differ`` (how many shapes differ,
    the first such name, its checkpoint shape and its model shape)."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} model parameter(s) not in the checkpoint (e.g. {missing[:3]})")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint parameter(s) not in the model (e.g. {unexpected[:3]})")
    if differ is not None:
        count, name, ck_shape, model_shape = differ
        parts.append(f"{count} shape(s) differ (e.g. {name}: checkpoint {tuple(ck_shape)} vs model "
                     f"{tuple(model_shape)})")
    return "; ".join(parts)


def check_model(manifest: layout.Manifest, index: Mapping[str, ParamEntry], strict: bool) -> list[str]:
    """Names to load. strict: the model must be the checkpoint's (names and shapes)."""
    ck = manifest.index
    missing = [n for n in index if n not in ck]
    unexpected = [n for n in ck if n not in index]
    shapes = [n for n in index if n in ck and ck[n].shape != index[n].shape]
    if strict and (missing or unexpected or shapes):
        first = shapes[0] if shapes else None
        differ = (len(shapes), first, ck[first].shape, index[first].shape) if shapes else None
        raise CheckpointError(
            f"checkpoint {manifest.path} is of another model: "
            f"{model_mismatch(missing, unexpected, differ)}. "
            "Load with strict=False to take the matching parameters only."
        )
    return [n for n in index if n in ck and n not in shapes]


def plan(manifest: layout.Manifest, index: Mapping[str, ParamEntry], segments, names: set[str]) -> list[_Request]:
    """Map this rank's segments (model order) to checkpoint ranges, merging contiguous runs."""
    reqs: list[_Request] = []
    ck = manifest.index
    for seg in segments:
        if isinstance(seg, LazySegment):
            if seg.write is None:
                raise CheckpointError(f"segment at {seg.offset} is read-only (a LazySegment without write)")

            def req(src, a, b, seg=seg):
                return _Request(src, sink=partial(_shifted, seg.write, a - seg.offset), n=b - a)
        else:
            t = seg.tensor.reshape(-1)

            def req(src, a, b, t=t, seg=seg):
                return _Request(src, dest=t[a - seg.offset: b - seg.offset])
        run_src = run_lo = run_hi = None
        for name, lo, hi in split_by_param(index, seg.offset, seg.end):
            if name not in names:
                continue
            src = ck[name].offset + (lo - index[name].offset)
            if run_src is not None and run_hi == lo and run_src + (run_hi - run_lo) == src:
                run_hi = hi
                continue
            if run_src is not None:
                reqs.append(req(run_src, run_lo, run_hi))
            run_src, run_lo, run_hi = src, lo, hi
        if run_src is not None:
            reqs.append(req(run_src, run_lo, run_hi))
    return reqs


def _by_unit(info: layout.ArrayInfo, requests: list[_Request]) -> dict[int, list[tuple]]:
    """For each chunk (or extent) the requests touch: (request, element in the unit's data
    where the run starts, global start, global end) of every run of it they overlap."""
    out: dict[int, list[tuple]] = defaultdict(list)
    if not info.extents:
        ce = info.chunk_elems
        for r in requests:
            for c in range(r.src // ce, -(-r.end // ce)):
                out[c].append((r, 0, c * ce, (c + 1) * ce))
        return out
    spans = sorted((off, off + n, i, at) for i, e in enumerate(info.extents) for at, off, n in e.spans if n)
    starts = [sp[0] for sp in spans]
    for r in requests:
        if not r.numel:
            continue
        j = max(0, bisect.bisect_right(starts, r.src) - 1)
        while j < len(spans) and spans[j][0] < r.end:
            off, end, i, at = spans[j]
            if end > r.src:
                out[i].append((r, at, off, end))
            j += 1
    return out


def chunks_of(info: layout.ArrayInfo, requests: list[_Request]) -> list[int]:
    """The chunks (or extents) ``requests`` touch, in order."""
    return sorted(_by_unit(info, [r for r in requests if r.numel]))


class ShardedLoad:
    """A load in two steps ([Note: verify, then apply]): `verify` reads and checks every chunk
    this rank will use, writing nothing; `apply` fills the template.

    [Note: verify, then apply] A load that fails halfway would leave the destination half
    old, half new. So the engine verifies first: the manifest is checked, the model
    matched, every chunk its ranges touch is read and crc-checked (bounded memory, a few
    chunks at a time), and only when that passed on every rank is anything written. The
    price is reading the ranges twice. `apply` checks every crc again; should it still fail
    (the disk changed in between), the engine marks itself unusable.
    """

    def __init__(self, load_dir: str | os.PathLike, tag: str | None, template: ShardedState, *,
                 kinds: Iterable[str] | None = None, strict: bool = True, comm: Comm | None = None,
                 threads: int = 4, progress: bool = False, aio: object | None = None):
        self.comm = comm or Comm.default()
        self.template = template
        self.manifest = resolve_tag(load_dir, tag, warn=self.comm.rank == 0)
        self.names = set(check_model(self.manifest, template.index, strict))
        self.kinds = list(template.arrays) if kinds is None else list(kinds)
        self.reader = ArrayReader(self.manifest, threads=threads, progress=progress and self.comm.rank == 0,
                                  aio=aio)
        for kind in self.kinds:
            self.reader.info(kind)  # every asked-for kind must exist before anything is overwritten
        self.requests = {kind: plan(self.manifest, template.index, template.arrays[kind], self.names)
                         for kind in self.kinds}
        for kind, reqs in self.requests.items():
            numel = self.reader.info(kind).numel
            for r in reqs:
                if r.src < 0 or r.end > numel:
                    raise CheckpointError(f"range [{r.src}, {r.end}) is outside array {kind!r} of {numel} "
                                          f"in {self.manifest.path}")

    def rank_scalars(self) -> dict[str, Any]:
        """This rank's per-rank scalars (RNG states): rank r of N reads those of rank r % N."""
        ranks = self.manifest.rank_scalars
        return ranks[self.comm.rank % len(ranks)] if ranks else {}

    def verify(self) -> None:
        """Every chunk this rank's ranges touch is read and its crc checked; nothing is written."""
        for kind, reqs in self.requests.items():
            self.reader.verify(kind, chunks_of(self.reader.info(kind), reqs))

    def apply(self) -> LoadResult:
        """Fill the template's segments (each chunk's crc checked again before use)."""
        for kind, reqs in self.requests.items():
            self.reader.read_requests(kind, reqs)
        m, index = self.manifest, self.template.index
        return LoadResult(
            manifest=m, path=m.tag_dir, tag=m.tag, scalars=m.scalars,
            rank_scalars=self.rank_scalars(),
            client_state=m.client_state,
            loaded_names=[n for n in index if n in self.names],
            skipped_names=[n for n in index if n not in self.names],
        )


def load_sharded(load_dir: str | os.PathLike, tag: str | None, template: ShardedState, *,
                 kinds: Iterable[str] | None = None, strict: bool = True,
                 comm: Comm | None = None, threads: int = 4, progress: bool = False,
                 verify_first: bool = False, aio: object | None = None) -> LoadResult:
    """Fill ``template``'s segments (this rank's ranges) from checkpoint ``tag`` of ``load_dir``.

    Not collective: each rank reads its own ranges, whatever world size wrote them. With
    ``verify_first`` every chunk is checked before the first byte is written, so a corrupt
    checkpoint leaves the template as it was ([Note: verify, then apply]).
    """
    load = ShardedLoad(load_dir, tag, template, kinds=kinds, strict=strict, comm=comm, threads=threads,
                       progress=progress, aio=aio)
    if verify_first:
        load.verify()
    return load.apply()
