"""Gradient shards paged through NVMe with the masters and moments they are stepped with.

[Note: paged gradients]
With paged masters at stage 3 ([Note: paged masters] in paged.py) and nothing accumulated
on the host (``gradient_accumulation_steps`` 1), the host gradient shard is no whole tensor
either: each swap piece has a fourth tensor in the optimizer's store, "grad" (the host
gradient dtype: 16-bit under the one-pass CPU Adam), homed on NVMe beside the piece's
master and moments, and ``ShardGroup.grad`` is a meta tensor. The host then holds only
windows of it, whatever the model's size:

- backward: the gradient landing (partition/stage3/grads.py) asks ``view`` for the host
  range a reduced group lands in (its landings are cut at piece boundaries, ``split``). The
  first view of a piece in a step acquires it *for overwrite* (nothing is read) and zeroes
  what no landing covers (padding); once every landing of the piece has landed
  (``landed``: the copy into it is waited for), the piece is released and its write-back
  starts at once (write-behind), so a handful of pieces are in host memory at a time. A
  piece of the resident head is held by the optimizer and simply stays;
- ``settle`` (the boundary, after the landing's host wait): pieces still open (a group that
  got no gradient this step) get zeros for the landings that did not land, and go;
- the step: the optimizer acquires each piece's gradient with its master and moments (read
  ahead with them; not in the read-ahead across the step boundary, which would read the
  previous step's gradient), and after the update drops it without writing it back: its
  bytes are dead until the next backward overwrites them (``TieredStore.drop``).

Bytes per step: each streamed piece's gradient is written once (backward) and read once
(the step): the swap plan counts it as a fourth tensor of the piece, each way. The squared
norm is taken on the device as the gradient lands ([Note: norm while consuming] in
grads.py); ``sq_norm`` reads the pieces back only where it could not be (a group reduced
twice in one backward).
"""

from __future__ import annotations

import torch

from zeroio.shard.pieces import PieceIndex, SubGroup
from zeroio.tiering.stats import StallTimer, TierStats


class PagedGrads:
    """See [Note: paged gradients]. ``store``, ``pieces``: the paged masters' (the optimizer's
    store and cut); ``ranges``: per optimizer group, the ``(base, numel)`` ranges the landing
    writes (every element of the shard that belongs to a parameter); ``dtype``: the host
    gradient's."""

    KIND = "grad"

    def __init__(self, store, pieces: list[SubGroup], ranges: dict[int, list[tuple[int, int]]],
                 dtype: torch.dtype, transfers: TierStats | None = None):
        from zeroio.tiering import Tier

        self.store, self.pieces, self.dtype = store, pieces, dtype
        self.transfers = transfers
        self.index = PieceIndex(pieces)
        self._expected = [0] * len(pieces)
        self._landings: list[list[tuple[int, int]]] = [[] for _ in pieces]  # (start, numel)
        for group, spans in ranges.items():
            for base, numel in spans:
                for lo, n in self.split(group, base, numel):
                    i = self.index.holding(group, lo)
                    self._landings[i].append((lo, n))
                    self._expected[i] += n
        for p in pieces:
            self.store.register(self.name(p), (p.numel,), dtype, home=Tier.NVME)
        self._open: dict[int, torch.Tensor] = {}  # piece -> its acquired host tensor
        self._filled = [0] * len(pieces)
        self._landed: set[tuple[int, int]] = set()  # (group, start) of the landings written

    def name(self, p: SubGroup) -> str:
        return p.name(self.KIND)

    def split(self, group: int, base: int, numel: int) -> list[tuple[int, int]]:
        """``(start, numel)`` of [base, base + numel) cut at the group's piece boundaries."""
        out = []
        for i in self.index.overlapping(group, base, base + numel):
            p = self.pieces[i]
            a, b = max(base, p.start), min(base + numel, p.start + p.numel)
            out.append((a, b - a))
        return out

    def view(self, group: int, start: int, numel: int, *, first: bool) -> torch.Tensor:
        """The host tensor elements [start, start + numel) of the group's gradient land in
        (within one piece; ``first``: this step's first write of them, which overwrites)."""
        i = self.index.holding(group, start)
        t = self._open.get(i)
        if t is None:
            t = self._acquire(i, overwrite=first)
        return t.narrow(0, start - self.pieces[i].start, numel)

    def _acquire(self, i: int, *, overwrite: bool) -> torch.Tensor:
        from zeroio.tiering import Tier

        p = self.pieces[i]
        t = self.store.acquire(self.name(p), Tier.CPU, overwrite=overwrite)
        if overwrite:  # contents undefined: zero what no landing writes (padding)
            at = 0  # within the piece
            for lo, n in sorted(self._landings[i]):
                if lo - p.start > at:
                    t.narrow(0, at, lo - p.start - at).zero_()
                at = max(at, lo - p.start + n)
            if at < p.numel:
                t.narrow(0, at, p.numel - at).zero_()
        self._open[i] = t
        return t

    def landed(self, group: int, start: int, numel: int, after=None) -> None:
        """The first write of [start, start + numel) was issued (``after``: the event it
        completes with, or None when it is done); a piece whose every landing has landed is
        released and its write-back started."""
        i = self.index.holding(group, start)
        if (group, start) in self._landed:
            return
        self._landed.add((group, start))
        self._filled[i] += numel
        if self._filled[i] == self._expected[i]:
            if after is not None:
                with StallTimer(self.transfers):
                    after.synchronize()  # the copy into the pinned piece has landed
            self._close(i, evict=True)

    def _close(self, i: int, *, evict: bool) -> None:
        from zeroio.tiering import Tier

        name = self.name(self.pieces[i])
        self._open.pop(i)
        self.store.mark_dirty(name, Tier.CPU)
        self.store.release(name, Tier.CPU)
        if evict:
            self.store.evict(name, Tier.CPU)  # write behind (a no-op on a held head piece)

    def settle(self) -> None:
        """The boundary, once every copy into host memory has landed: zeros for landings that
        got no gradient this step, and every piece still open goes."""
        for i, spans in enumerate(self._landings):
            g = self.pieces[i].group_index
            missing = [(lo, n) for lo, n in spans if (g, lo) not in self._landed]
            if not missing:
                continue
            t = self._open.get(i)
            if t is None:
                t = self._acquire(i, overwrite=self._filled[i] == 0)
            for lo, n in missing:
                t.narrow(0, lo - self.pieces[i].start, n).zero_()
        for i in list(self._open):
            self._close(i, evict=True)

    def reset(self) -> None:
        """A new step: nothing has landed."""
        self._filled = [0] * len(self.pieces)
        self._landed = set()

    def sq_norm(self) -> torch.Tensor:
        """The fp32 squared norm of every piece's gradient, read back through the store (only
        where it was not taken while landing)."""
        from zeroio.tiering import Tier

        total = torch.zeros((), dtype=torch.float64)
        for p in self.pieces:
            t = self.store.acquire(self.name(p), Tier.CPU)
            try:
                total += torch.linalg.vector_norm(t.float()).double() ** 2
            finally:
                self.store.release(self.name(p), Tier.CPU)
        return total.float()

    def close(self) -> None:
        for i in list(self._open):
            self._close(i, evict=False)


__all__ = ["PagedGrads"]
