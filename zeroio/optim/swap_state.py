"""What a checkpoint reads and writes of ``SwappedAdam``'s state (optim/swap.py): the masters
and moments as local tensors and ranges, piece by piece through the tiered store, and its swap
files, which a save may share. A load replaces the pieces whole, without reading them:

[Note: a load replaces pieces whole]
A step refused because a swap file is missing or damaged names the remedy: load a
checkpoint. That load overwrites every element of every piece the checkpoint holds, so it
has no use for the old bytes; reading them first (an acquire before the copy) would fail
on the very file that made the step fail, and the remedy could never work. So while a load
of every parameter runs, the optimizer's ``write_local_range`` takes each piece the first
time it touches it with ``acquire(overwrite=True)``, which allocates the window's copy
without a read, zeroes it (the elements no parameter owns are padding, kept zero:
shard/types.py) and copies the checkpoint's values in; the piece is dirty, and its
write-back replaces the swap file whole (a whole-chunk write reads nothing and recreates a
missing file: [Note: concurrent range writes] in io/store.py). The reader writes a piece's
ranges from several threads and in any order (a checkpoint chunk seldom ends where a piece
does), so each piece has a lock: the first writer replaces, later writers acquire as
usual, which finds the piece in the window or reads back the whole-piece write-back of the
first; never the old file. A load that skips parameters (``strict=False`` with a model
that differs) does not replace: the skipped elements keep their values, read as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from zeroio.optim.swap_plan import SubGroup


class SwappedStateAccess:
    """The checkpoint side of ``SwappedAdam`` (a mixin: it uses the optimizer's ``groups``,
    ``pieces``, ``index``, ``store``, ``paged``, ``state_kinds``, ``steps``, ``drain`` and the attributes its
    constructor sets: ``_tier``, ``_kinds``, ``_dtypes``, ``_state_pins``)."""

    _replacing: PieceReplacement | None = None  # [Note: a load replaces pieces whole]

    def _store_kind(self, kind: str) -> str | None:
        """The store's name for a checkpoint ``kind`` (None: not in the store)."""
        if kind == "fp32":
            return "master" if self.paged is not None else None
        return kind

    def local_tensor(self, group_index: int, kind: str) -> torch.Tensor:
        """A host copy of the group's local ``kind`` tensor (moments gathered from the store).

        Checkpoint saves use ``read_local`` instead (piece by piece, no whole copy)."""
        g = self.groups[group_index]
        if self._store_kind(kind) is None:
            return g.master
        kind = self._store_kind(kind)
        out = torch.empty(g.padded_numel, dtype=self._dtypes[kind])  # the pieces tile it
        for sub in (self.pieces[i] for i in self.index.of_group(group_index)):
            with self._state_pins:
                t = self.store.acquire(sub.name(kind), self._tier)
                out.narrow(0, sub.start, sub.numel).copy_(t)
                self.store.release(sub.name(kind), self._tier)
        return out

    reads_ranges = True

    def read_local(self, group_index: int, kind: str, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of the group's local ``kind`` tensor, as a new host tensor.

        Reads only the pieces that overlap the range (from the store's CPU or
        NVMe tier, never via a GPU), so a checkpoint writer holds one piece per
        thread, not a copy of every moment. Safe to call from several threads.
        """
        g = self.groups[group_index]
        if lo < 0 or n < 0 or lo + n > g.padded_numel:
            raise IndexError(f"read_local: [{lo}, {lo + n}) outside group {group_index}'s "
                             f"{g.padded_numel} elements")
        if self._store_kind(kind) is None:
            return g.master.narrow(0, lo, n)
        kind = self._store_kind(kind)
        out = torch.empty(n, dtype=self._dtypes[kind])
        for resident, at in self._resident_pieces(group_index, kind, lo, n, dirty=False):
            out.narrow(0, at, resident.numel()).copy_(resident)
        return out

    def _overlaps(self, group_index: int, lo: int, n: int) -> Iterator[tuple[SubGroup, int, int]]:
        """Each piece overlapping [lo, lo + n) of the group (found through the optimizer's
        ``PieceIndex``), with the overlap [a, b)."""
        for sub in (self.pieces[i] for i in self.index.overlapping(group_index, lo, lo + n)):
            a, b = max(lo, sub.start), min(lo + n, sub.start + sub.numel)
            if a < b:
                yield sub, a, b

    def _resident_pieces(self, group_index: int, kind: str, lo: int, n: int, *, dirty: bool):
        """For each piece overlapping [lo, lo + n) of the group's ``kind`` state: its
        overlapping slice, resident and pinned while the caller uses it, and where that slice
        starts within the range. ``dirty``: the caller writes it (written back later)."""
        for sub, a, b in self._overlaps(group_index, lo, n):
            with self._state_pins:
                t = self.store.acquire(sub.name(kind), self._tier)
                try:
                    yield t.narrow(0, a - sub.start, b - a), a - lo
                    if dirty:
                        self.store.mark_dirty(sub.name(kind), self._tier)
                finally:
                    self.store.release(sub.name(kind), self._tier)

    def write_local_range(self, group_index: int, kind: str, lo: int, values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of the group's local ``kind`` tensor
        (checkpoint load, chunk by chunk: no whole host copy). Safe from several threads."""
        g = self.groups[group_index]
        n = values.numel()
        if lo < 0 or lo + n > g.padded_numel:
            raise IndexError(f"write_local_range: [{lo}, {lo + n}) outside group {group_index}'s "
                             f"{g.padded_numel} elements")
        if self._store_kind(kind) is None:
            g.master.narrow(0, lo, n).copy_(values)
            return
        if kind == "fp32":
            self.paged.stale = True  # the 16-bit shards are republished from the store
        kind = self._store_kind(kind)
        replacing = self._replacing
        if replacing is None or not replacing.covers(kind):
            for resident, at in self._resident_pieces(group_index, kind, lo, n, dirty=True):
                resident.copy_(values.narrow(0, at, resident.numel()))
            return
        replacing.write(self.store, self._tier, self._state_pins,
                        self._overlaps(group_index, lo, n), kind, lo, values)

    @contextmanager
    def replacing(self, kinds: tuple[str, ...]) -> Iterator[None]:
        """Inside, a checkpoint load writes every element of ``kinds``: each piece is replaced
        whole, never read ([Note: a load replaces pieces whole] in this module)."""
        self._replacing = PieceReplacement(self._store_kind(kind) for kind in kinds)
        try:
            yield
        finally:
            self._replacing = None

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        """Overwrite the group's local ``kind`` tensor (checkpoint load)."""
        g = self.groups[group_index]
        if self._store_kind(kind) is None:
            g.master.copy_(values)
            return
        if kind == "fp32":
            self.paged.stale = True
        kind = self._store_kind(kind)
        for sub in (self.pieces[i] for i in self.index.of_group(group_index)):
            # each piece whole: replaced, never read
            t = self.store.acquire(sub.name(kind), self._tier, overwrite=True)
            t.copy_(values.narrow(0, sub.start, sub.numel))
            self.store.release(sub.name(kind), self._tier)

    def flush_swap(self) -> int:
        """Write the dirty pieces (resident head, window) to their swap files and wait; the
        bytes written. A checkpoint then shares the files ([Note: shared chunk files] in
        zeroio/io/store.py): each dirty moment is written once, never copied again."""
        before = self.store.stats()["bytes_moved"].get("cpu->nvme", 0)
        self.drain()
        self.store.flush()
        return self.store.stats()["bytes_moved"].get("cpu->nvme", 0) - before

    @property
    def swapped_kinds(self) -> tuple[str, ...]:
        """The checkpoint kinds this optimizer keeps in swap files (a save may link them):
        the state kinds, and "fp32" when the masters page ([Note: where the masters live])."""
        return (("fp32",) if self.paged is not None else ()) + tuple(self.state_kinds)

    def swap_files(self, group_index: int, kind: str) -> list[tuple[str, int, int, int, int]] | None:
        kind = self._store_kind(kind)
        if kind not in self._kinds:
            return None
        out = []
        for sub in (self.pieces[i] for i in self.index.of_group(group_index)):
            files = self.store.home_files(sub.name(kind))
            if files is None:
                return None
            out += [(path, sub.start + first, n, nbytes, crc_at)
                    for path, first, n, nbytes, crc_at in files]
        return out

    def steps_taken(self, group_index: int) -> int:
        return max((int(v.item()) for s, v in self.steps.items() if s.group_index == group_index),
                   default=0)

    def set_steps(self, group_index: int, steps: int) -> None:
        for s, v in self.steps.items():
            if s.group_index == group_index:
                v.fill_(float(steps))


class PieceReplacement:
    """The pieces a load has begun replacing, and one lock per piece (by store name)."""

    def __init__(self, kinds: Iterable[str | None]):
        self.kinds = frozenset(k for k in kinds if k is not None)
        """The store kinds every element of which the load writes."""
        self._begun: set[str] = set()
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def covers(self, kind: str) -> bool:
        return kind in self.kinds

    def write(self, store, tier, pins, overlaps: Iterable[tuple], kind: str, lo: int,
              values: torch.Tensor) -> None:
        """Write ``values`` (elements [lo, lo + len) of a group's ``kind``) into the pieces
        ``overlaps`` gives ((piece, a, b): the piece's overlap [a, b)), each replaced on its
        first write. ``pins``: the optimizer's bound on pieces pinned for checkpoints."""
        for sub, a, b in overlaps:
            name = sub.name(kind)
            with self.piece(name) as first, pins:
                t = store.acquire(name, tier, overwrite=first)
                try:
                    if first:
                        t.zero_()  # the padding; the load writes every other element
                    t.narrow(0, a - sub.start, b - a).copy_(values.narrow(0, a - lo, b - a))
                    store.mark_dirty(name, tier)
                finally:
                    store.release(name, tier)

    @contextmanager
    def piece(self, name: str) -> Iterator[bool]:
        """Hold ``name``'s lock; yields whether this is the load's first write of it (then it
        is replaced, not read). A first write that raises leaves it not begun."""
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            first = name not in self._begun
            yield first
            self._begun.add(name)


__all__ = ["PieceReplacement", "SwappedStateAccess"]
