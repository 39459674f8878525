"""`ShardedState`: what one rank hands the checkpoint layer, and what it gets filled.

[Note: global flat order] Every array kind ("fp32" master weights,
"exp_avg", "exp_avg_sq", ...) is one 1-D array over the whole model in the
order of `model.named_parameters()` (tied parameters once), unpadded. The
`index` maps each parameter name to its (offset, shape) in that order. A rank
owns any set of `(global_offset, 1-D tensor)` segments of it; on save they are
written where they belong, on load they are filled from there. Because the
layout never mentions ranks, a checkpoint written by N ranks at stage s is
read by M ranks at stage t with no conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroio.errors import CheckpointError


@dataclass(frozen=True, kw_only=True)
class ParamEntry:
    """Where one parameter lives in the global flat order."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Segment:
    """``tensor`` (1-D) holds elements [offset, offset + numel) of the global flat array."""

    offset: int
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def end(self) -> int:
        return self.offset + self.tensor.numel()


@dataclass(frozen=True, kw_only=True)
class LazySegment:
    """Elements [offset, offset + numel) of the global flat array, read piece by piece on save.

    ``read(lo, n)`` returns elements [lo, lo + n) of this segment (local offsets)
    as a 1-D tensor of ``dtype`` that the writer may keep until it has written
    it. State that lives elsewhere (NVMe-resident moments) reaches the
    checkpoint this way without a whole host copy: at most one piece per
    writer thread is in memory. ``read`` is called from writer threads.
    On load, ``write(lo, values)`` stores elements [lo, lo + len(values)) as each
    verified chunk arrives (called from reader threads); a lazy segment without
    ``write`` cannot be loaded into.
    """

    offset: int
    numel: int
    dtype: torch.dtype
    read: Callable[[int, int], torch.Tensor]
    write: Callable[[int, torch.Tensor], None] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, kw_only=True)
class SharedFile:
    """A file that already holds some of this rank's elements of one array (a chunk file of
    the NVMe swap store), given to the checkpoint by name instead of by value: it is
    reflinked, hard-linked or copied into the tag ([Note: shared extents] in shared.py).

    The file is ``nbytes`` long; its first ``crc_at`` bytes (the data, padded) are followed by
    their crc32c. ``spans`` are (element in the file, global offset, elements) runs of the
    global flat order it holds; the rest of the file (padding) is not part of the array."""

    path: str
    nbytes: int
    crc_at: int
    spans: tuple[tuple[int, int, int], ...]


def segment_dtype(s: Segment | LazySegment) -> torch.dtype:
    return s.dtype if isinstance(s, LazySegment) else s.tensor.dtype


def build_index(named_shapes: Mapping[str, tuple[int, ...]] | list[tuple[str, tuple[int, ...]]]):
    """An index over names in the given order, offsets packed without padding."""
    items = named_shapes.items() if isinstance(named_shapes, Mapping) else named_shapes
    index: dict[str, ParamEntry] = {}
    offset = 0
    for name, shape in items:
        entry = ParamEntry(offset=offset, shape=tuple(int(s) for s in shape))
        index[name] = entry
        offset += entry.numel
    return index


@dataclass(kw_only=True)
class ShardedState:
    """One rank's view of a checkpoint.

    ``scalars`` and ``client_state`` are JSON values that every rank holds
    alike (rank 0's copy is written). ``rank_scalars`` is JSON private to
    this rank (RNG states); a reader of another world size gets the one of
    rank ``r % N``. ``meta`` describes the writer (stage, dtype, HF config).
    """

    index: dict[str, ParamEntry]
    arrays: dict[str, list[Segment | LazySegment]] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    rank_scalars: dict[str, Any] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, list[SharedFile]] = field(default_factory=dict)
    """Kinds stored as extents (shared files plus, for this rank's ``arrays`` of that kind,
    files the save writes); the other kinds are chunked arrays."""

    @property
    def numel(self) -> int:
        if not self.index:
            return 0
        last = max(self.index.values(), key=lambda e: e.offset)
        return last.offset + last.numel

    def validate(self) -> None:
        """The index tiles [0, numel) (what a reader checks, [Note: manifest checks] in
        layout.py); segments are 1-D, inside the array, and do not overlap within a kind."""
        pos = 0
        for name, e in sorted(self.index.items(), key=lambda kv: (kv[1].offset, kv[1].numel)):
            if e.offset != pos:
                raise CheckpointError(f"index entry {name!r} starts at {e.offset}, the entries before it "
                                      f"end at {pos}: an index must tile the flat order (no gap, no overlap)")
            pos += e.numel
        total = self.numel
        for kind in set(self.arrays) | set(self.shared):
            segments = self.arrays.get(kind, [])
            spans = sorted([(s.offset, s.end) for s in segments]
                           + [(g, g + n) for f in self.shared.get(kind, []) for _e, g, n in f.spans])
            for s in segments:
                if isinstance(s, Segment) and s.tensor.dim() != 1:
                    raise CheckpointError(
                        f"array {kind!r}: segment at {s.offset} is {s.tensor.dim()}-D; segments are 1-D"
                    )
            for (a0, a1), (b0, _b1) in zip(spans, spans[1:], strict=False):
                if b0 < a1:
                    raise CheckpointError(
                        f"array {kind!r}: segments [{a0}, {a1}) and [{b0}, ...) overlap"
                    )
            if spans and (spans[0][0] < 0 or spans[-1][1] > total):
                raise CheckpointError(
                    f"array {kind!r}: segments span [{spans[0][0]}, {spans[-1][1]}) "
                    f"outside the model's {total} elements"
                )


def split_by_param(index: Mapping[str, ParamEntry], start: int, end: int) -> Iterator[tuple[str, int, int]]:
    """(name, global_start, global_end) pieces of [start, end) cut at parameter boundaries."""
    for name, e in index.items():
        lo, hi = max(start, e.offset), min(end, e.offset + e.numel)
        if lo < hi:
            yield name, lo, hi
