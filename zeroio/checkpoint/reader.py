"""Loading: find the tag, check the manifest against the model, read each rank's ranges.

Every chunk that is read is checked against the crc32c the manifest recorded
for it before any of its bytes are used, so a corrupted or truncated array is
a CheckpointError naming the chunk file, never silently wrong weights.
"""

from __future__ import annotations

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

from zeroio.checkpoint import layout
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.crc import crc32c
from zeroio.checkpoint.state import LazySegment, ParamEntry, ShardedState, split_by_param
from zeroio.checkpoint.storage import FileIO, open_engine, read_chunk
from zeroio.errors import CheckpointError


class CheckpointWarning(UserWarning):
    """A checkpoint directory holds something that was skipped (an interrupted save)."""


def resolve_tag(root: str | os.PathLike, tag: str | None = None, *, warn: bool = True) -> layout.Manifest:
    """The manifest of ``tag``, or of the newest complete tag when ``tag`` is None.

    With ``tag=None`` the tag named by `latest` is used; if it is incomplete,
    the newest complete tag is used with a warning naming the broken one.
    Incomplete tags are always reported (CheckpointWarning). An explicit tag
    that is missing or incomplete is a CheckpointError.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    tags = scan = layout.scan_tags(root)
    complete = [t for t in scan if t.complete]
    broken = [t for t in scan if not t.complete]

    def report(skip: Iterable[layout.TagStatus]) -> None:
        if warn:
            for t in skip:
                warnings.warn(f"ignoring incomplete checkpoint {t.path}: {t.reason}", CheckpointWarning,
                              stacklevel=3)

    if tag is not None:
        tdir = layout.tag_dir(root, tag)
        if not tdir.is_dir():
            raise CheckpointError(
                f"checkpoint tag {tag!r} not found in {root}; complete tags: {[t.tag for t in complete]}"
            )
        status = next((t for t in tags if t.tag == tag), None)
        if status is None or not status.complete:
            reason = status.reason if status else "not a zeroio checkpoint (no zarr.json with zeroio attributes)"
            raise CheckpointError(f"checkpoint {tdir} is incomplete: {reason}")
        report(t for t in broken if t.created_unix > status.created_unix)
        return layout.read_manifest(tdir / layout.MANIFEST)

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
    """Verified range reads of one checkpoint's arrays."""

    def __init__(self, manifest: layout.Manifest, threads: int = 4, progress: bool = False):
        self.manifest = manifest
        self.threads = threads
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
                f"{got:#010x}, manifest {self.manifest.path} recorded {want:#010x}"
            )
        return buf.view(info.dtype)

    def read_requests(self, kind: str, requests: list[_Request], desc: str = "") -> None:
        info = self.info(kind)
        ce = info.chunk_elems
        by_chunk: dict[int, list[_Request]] = defaultdict(list)
        for r in requests:
            if r.src < 0 or r.end > info.numel:
                raise CheckpointError(f"range [{r.src}, {r.end}) is outside array {kind!r} of {info.numel}")
            for c in range(r.src // ce, -(-r.end // ce)):
                by_chunk[c].append(r)

        def one(c: int) -> int:
            data = self._chunk(engine, info, c)
            base = c * ce
            for r in by_chunk[c]:
                lo, hi = max(r.src, base), min(r.end, base + ce)
                r.put(lo - r.src, data[lo - base: hi - base])
            return info.chunk_nbytes

        bar = tqdm(total=len(by_chunk) * info.chunk_nbytes, unit="B", unit_scale=True,
                   desc=desc or f"load {kind}", disable=not self.progress, leave=False)
        # chunks are verified and scattered on this pool; their bytes move on the engine's
        with FileIO(self.threads) as io, open_engine(self.threads) as engine:
            for f in [io.submit(one, c) for c in sorted(by_chunk)]:
                bar.update(f.result())
        bar.close()

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
        self._engine = open_engine(reader.threads)
        self._pool = FileIO(depth)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(chunk index, its elements in the stored dtype), in the order given."""
        order = iter(self._chunks)
        pending: deque[tuple[int, Future]] = deque()

        def top_up() -> None:
            while len(pending) < self.depth and (c := next(order, None)) is not None:
                pending.append((c, self._pool.submit(self.reader._chunk, self._engine, self.info, c)))

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


def check_model(manifest: layout.Manifest, index: Mapping[str, ParamEntry], strict: bool) -> list[str]:
    """Names to load. strict: the model must be the checkpoint's (names and shapes)."""
    ck = manifest.index
    missing = [n for n in index if n not in ck]
    unexpected = [n for n in ck if n not in index]
    shapes = [n for n in index if n in ck and ck[n].shape != index[n].shape]
    if strict and (missing or unexpected or shapes):
        parts = []
        if missing:
            parts.append(f"{len(missing)} model parameter(s) not in the checkpoint (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint parameter(s) not in the model (e.g. {unexpected[:3]})")
        if shapes:
            n = shapes[0]
            parts.append(f"{len(shapes)} shape(s) differ (e.g. {n}: checkpoint {ck[n].shape} vs model "
                         f"{index[n].shape})")
        raise CheckpointError(
            f"checkpoint {manifest.path} is of another model: {'; '.join(parts)}. "
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


def load_sharded(load_dir: str | os.PathLike, tag: str | None, template: ShardedState, *,
                 kinds: Iterable[str] | None = None, strict: bool = True,
                 comm: Comm | None = None, threads: int = 4, progress: bool = False) -> LoadResult:
    """Fill ``template``'s segments (this rank's ranges) from checkpoint ``tag`` of ``load_dir``.

    Not collective: each rank reads its own ranges, whatever world size wrote them.
    """
    comm = comm or Comm.default()
    manifest = resolve_tag(load_dir, tag, warn=comm.rank == 0)
    names = set(check_model(manifest, template.index, strict))
    kinds = list(template.arrays) if kinds is None else list(kinds)
    reader = ArrayReader(manifest, threads=threads, progress=progress and comm.rank == 0)
    for kind in kinds:
        reader.info(kind)  # every asked-for kind must exist before anything is overwritten
    for kind in kinds:
        reader.read_requests(kind, plan(manifest, template.index, template.arrays[kind], names))
    ranks = manifest.rank_scalars
    return LoadResult(
        manifest=manifest, path=manifest.tag_dir, tag=manifest.tag,
        scalars=manifest.scalars,
        rank_scalars=ranks[comm.rank % len(ranks)] if ranks else {},
        client_state=manifest.client_state,
        loaded_names=[n for n in template.index if n in names],
        skipped_names=[n for n in template.index if n not in names],
    )
