"""Masters paged through NVMe: the handle a partitioner and the NVMe optimizer share.

[Note: paged masters]
With ``offload_optimizer.masters`` nvme (or "auto" when the host budget cannot hold masters
and moments: config/zero.py, ``masters_paged``) no ShardGroup holds its master shard: its
``master`` is a meta tensor (the size and dtype, no storage) and the values live in the NVMe
optimizer's tiered store, one "master" tensor per swap piece beside the piece's moments
([Note: where the masters live] in optim/swap.py). ``PagedMasters`` is what the two sides
exchange:

- it is built by the partitioner (stage 3's, or stage 1/2's: [Note: stage 1/2 paged
  masters] in partition/stage12_paged.py) before it flattens its groups, and it builds the
  optimizer's store then (``zeroio-optim-rank<r>`` under ``offload_optimizer.nvme_path``)
  and decides the optimizer's piece cut (``pieces``: sub-groups of ``sub_group_size`` cut
  into pieces of ``piece_elems``, [Note: pieces stay large] in swap_rule.py);
- the partitioner ``seed``s the initial masters as it flattens each parameter group: each
  piece is gathered in one piece-sized host buffer and registered in the store, homed on
  NVMe, as soon as it is whole, so the masters reach the disk once, in their final files,
  and the host never holds more than one piece per group of them; ``finish_seeding``
  registers what no seed covered (padding: zeros) and ends the progress bar;
- the NVMe optimizer (``SwappedAdam``) takes that store and cut as its own (``adopt``),
  registers the moments beside the masters and sets the store's budgets to its plan;
- from then on ``read`` / ``write`` go to the optimizer's pieces (``read_local`` /
  ``write_local_range`` of kind "fp32"): the partitioner's ``write_back`` (a
  GatheredParameters modifier) and its republish after a checkpoint load use them;
- the step calls ``publish`` with each updated master piece while it is in the window: the
  partitioner casts it into the 16-bit shards (stage 3) or its slices of the 16-bit replica
  (stages 1 and 2) there (per piece, no full host master);
- ``stale``: the masters were written from outside the step (checkpoint load): the next
  ``publish_params`` republishes every piece from the store.

If initialize fails before the optimizer adopts the store (a CapacityError, a full disk),
``close`` deletes every file the store wrote and the folders made for it: nvme_path is left
as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeroio.errors import ConfigError
from zeroio.io import progress
from zeroio.io.hostmem import host_zeros
from zeroio.shard.pieces import PieceIndex, SubGroup, pieces_of, split_numels
from zeroio.shard.swap_rule import piece_elems_for, read_ahead
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


@dataclass(frozen=True, kw_only=True)
class PieceCut:
    """How the optimizer's shard is cut into swap pieces ([Note: pieces stay large])."""

    sub_group_size: int
    """``zero_optimization.sub_group_size``: the pieces never cross a sub-group."""
    piece_elems: int
    """Elements per piece at most."""

    @staticmethod
    def for_paged(*, offload, tiering, master_itemsize: int, state_itemsize: int) -> PieceCut:
        """The cut of paged masters, decided before the host budget is split: the window (a
        piece being updated and the read-ahead) takes at most a quarter of
        ``tiering.cpu_budget_bytes`` (``offload``: the resolved ``offload_optimizer`` policy;
        ``tiering``: the resolved tiering policy)."""
        ahead = read_ahead(tiering.prefetch_depth, bool(offload.pipeline_read))
        elems = piece_elems_for(tiering.cpu_budget_bytes,
                                itemsize=(master_itemsize + 2 * state_itemsize) / 2, ahead=ahead)
        return PieceCut(sub_group_size=offload.sub_group_size, piece_elems=elems)


class PagedMasters:
    """See [Note: paged masters]. ``group_numels``: each optimizer group's padded local
    length; ``offload``, ``tiering``: the resolved ``offload_optimizer`` and tiering policies."""

    def __init__(self, group_numels: dict[int, int], dtype: torch.dtype, *, cut: PieceCut,
                 offload, tiering, aio, rank: int, state_dtype: torch.dtype = torch.float32,
                 backend=None, transfers: TierStats | None = None):
        """``state_dtype``: the moments' (the store's CPU tier is sized for all three kinds
        until the optimizer plans it); ``transfers``: the partitioner's host <-> device copy
        stats (masters seeded from device parameters cross once, at construction). Rank 0
        shows a bar while the masters are written (unless ``zeroio.io.progress`` is
        quiet)."""
        from zeroio.tiering import PolicyKind, TieredStore

        self.numel = sum(group_numels.values())
        self.dtype, self.transfers, self.cut = dtype, transfers, cut
        self.publish: Callable[[int, int, torch.Tensor], None] | None = None
        """The partitioner's per-piece publication: (group, local start, master values)."""
        self.stale = False
        self.grads = None
        """The gradients' ``PagedGrads`` when they page too ([Note: paged gradients] in
        paged_grads.py; set by the partitioner once its landing is planned), else None."""
        self._owner = None
        nvme_path = offload.nvme_path
        if nvme_path is None and backend is None:
            raise ConfigError('offload_optimizer.device is "nvme" but no nvme_path is set',
                              key="zero_optimization.offload_optimizer.nvme_path")
        self.pieces: list[SubGroup] = pieces_of(
            split_numels(sorted(group_numels.items()), cut.sub_group_size), cut.piece_elems)
        self.index = PieceIndex(self.pieces)
        self.folder: str | None = None
        """The folder made for the store (removed by whoever closes the store, when empty)."""
        self.path = None if nvme_path is None else os.path.join(str(nvme_path),
                                                                f"zeroio-optim-rank{rank}")
        if self.path is not None:
            from zeroio.io import swapdir

            swapdir.remove_stale(nvme_path)  # crashed runs' folders, any rank's
            self.folder = swapdir.own_folder(self.path)
        total = self.numel * dtype.itemsize
        # every piece's three tensors, whole pages each: no plan asks for more
        state = self.numel * (dtype.itemsize + 2 * state_dtype.itemsize) + \
            3 * 4096 * len(self.pieces)
        self.store = TieredStore(tiering, aio, nvme_path=self.path, backend=backend,
                                 gpu_budget_bytes=0, prefetch_depth=0,
                                 cpu_budget_bytes=max(4096, min(
                                     state, tiering.cpu_budget_bytes or state)),
                                 policy=PolicyKind.parse(tiering.policy))
        """The optimizer's store, built here: its CPU budget an upper bound that ``adopt``'s
        owner lowers to its plan (seeding writes from the partitioner's buffers, not from
        the CPU tier)."""
        self._filling: dict[int, tuple[torch.Tensor, int]] = {}  # piece -> (buffer, high mark)
        self._registered: set[int] = set()
        self._bar = progress.bar(total=total, desc="masters to NVMe", unit="B", show=rank == 0)

    # -- seeding (construction, before ``adopt``) -------------------------------------------
    def seed(self, group: int, lo: int, values: torch.Tensor) -> None:
        """The initial masters of elements [lo, lo + len(values)) of ``group``: copied into
        each piece's buffer; a piece is written to its NVMe home once it is whole (seeds of a
        group come in ascending order: a seed past a piece's end completes it)."""
        hi = lo + values.numel()
        for i in self.index.overlapping(group, lo, hi):
            p = self.pieces[i]
            a, b = max(lo, p.start), min(hi, p.start + p.numel)
            src = values.narrow(0, a - lo, b - a)
            if i in self._registered:  # a seed out of order: through the store
                self._write_registered(p, a, src)
                continue
            buf, high = self._filling.get(i) or (  # page-aligned: written without a bounce
                host_zeros(p.numel, self.dtype, pin=False), 0)
            Copies(self.transfers).into(buf.narrow(0, a - p.start, b - a), src)
            self._filling[i] = (buf, max(high, b))
            if b == p.start + p.numel:
                self._register(i)
        for i in [i for i in self._filling if self.pieces[i].group_index == group
                  and self.pieces[i].start + self.pieces[i].numel <= lo]:
            self._register(i)  # passed over: the rest of it is padding

    def finish_seeding(self) -> None:
        """Register every piece not registered yet (partly seeded: its padding zero; never
        seeded: zeros) and close the progress bar. The partitioner calls it once it has
        flattened every group."""
        for i in range(len(self.pieces)):
            if i not in self._registered:
                self._register(i)
        self._bar.close()

    def _register(self, i: int) -> None:
        from zeroio.tiering import Tier

        p = self.pieces[i]
        buf, _ = self._filling.pop(i, (None, 0))
        self.store.register(p.name("master"), (p.numel,), self.dtype, home=Tier.NVME,
                            init=buf)
        self._registered.add(i)
        self._bar.update(p.numel * self.dtype.itemsize)

    def _write_registered(self, p: SubGroup, at: int, values: torch.Tensor) -> None:
        from zeroio.tiering import Tier

        name = p.name("master")
        t = self.store.acquire(name, Tier.CPU)
        try:
            Copies(self.transfers).into(t.narrow(0, at - p.start, values.numel()), values)
            self.store.mark_dirty(name, Tier.CPU)
        finally:
            self.store.release(name, Tier.CPU)

    # -- after seeding ------------------------------------------------------------------------
    def read(self, group: int, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of ``group``'s masters, as a new host tensor."""
        if self._owner is not None:
            return self._owner.read_local(group, "fp32", lo, n)
        from zeroio.tiering import Tier

        out = torch.zeros(n, dtype=self.dtype)
        for i in self.index.overlapping(group, lo, lo + n):
            p = self.pieces[i]
            a, b = max(lo, p.start), min(lo + n, p.start + p.numel)
            t = self.store.acquire(p.name("master"), Tier.CPU)
            try:
                out.narrow(0, a - lo, b - a).copy_(t.narrow(0, a - p.start, b - a))
            finally:
                self.store.release(p.name("master"), Tier.CPU)
        return out

    def write(self, group: int, lo: int, values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of ``group``'s masters (after ``adopt``)."""
        if self._owner is None:
            raise RuntimeError("PagedMasters.write before the optimizer adopted the masters")
        self._owner.write_local_range(group, "fp32", lo, values)

    def adopt(self, owner) -> None:
        """The optimizer owns the store now (``owner``: its ``read_local`` and
        ``write_local_range`` serve kind "fp32"; its ``close`` closes the store)."""
        if len(self._registered) != len(self.pieces):
            raise RuntimeError("PagedMasters.adopt before finish_seeding")
        self._owner = owner

    def close(self) -> None:
        """Before ``adopt`` (a failed initialize): close the store, which deletes every file
        it wrote, and remove the folders made for it. After: the owner closes the store."""
        self._bar.close()
        self._filling.clear()
        if self._owner is not None:
            return
        self.store.close()
        from zeroio.io import swapdir

        if self.folder is not None:
            swapdir.remove_if_empty(self.folder)


__all__ = ["PagedMasters", "PieceCut"]
