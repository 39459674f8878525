"""The NVMe optimizer's state read and written from outside the step: ``SwapStateAccess``
holds these methods of ``SwappedAdam`` (swap.py), whose store, pieces and index they use.

Checkpoints save and load the state piece by piece (``read_local``, ``write_local_range``:
only the pieces that overlap a range, found through the ``PieceIndex``, each pinned in the
store while it is copied, at most two at a time beside the step's window), or share the swap
files themselves (``swap_files`` after ``flush_swap``: [Note: shared chunk files] in
zeroio/io/store.py). The paged masters are kind "fp32" here ([Note: where the masters live]
in swap.py).
"""

from __future__ import annotations

import torch


class SwapStateAccess:
    """State access of ``SwappedAdam`` (module doc); mixed into it."""

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

    def _resident_pieces(self, group_index: int, kind: str, lo: int, n: int, *, dirty: bool):
        """For each piece overlapping [lo, lo + n) of the group's ``kind`` state: its
        overlapping slice, resident and pinned while the caller uses it, and where that slice
        starts within the range. ``dirty``: the caller writes it (written back later)."""
        for sub in (self.pieces[i] for i in self.index.overlapping(group_index, lo, lo + n)):
            a, b = max(lo, sub.start), min(lo + n, sub.start + sub.numel)
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
        for resident, at in self._resident_pieces(group_index, kind, lo, n, dirty=True):
            resident.copy_(values.narrow(0, at, resident.numel()))

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
            t = self.store.acquire(sub.name(kind), self._tier)
            t.copy_(values.narrow(0, sub.start, sub.numel))
            self.store.mark_dirty(sub.name(kind), self._tier)
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

    def swap_files(self, group_index: int,
                   kind: str) -> list[tuple[str, int, int, int, int]] | None:
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
