"""Masters paged through NVMe: the handle a partitioner and the NVMe optimizer share.

[Note: paged masters]
With ``offload_optimizer.masters`` nvme (or "auto" when the host budget cannot hold masters
and moments: config/zero.py, ``masters_paged``) no ShardGroup holds its master shard: its
``master`` is a meta tensor (the size and dtype, no storage) and the values live in the NVMe
optimizer's tiered store, one "master" tensor per swap piece beside the piece's moments
([Note: where the masters live] in optim/swap.py). ``PagedMasters`` is what the two sides
exchange:

- the partitioner (stage 3's, or stage 1/2's: [Note: stage 1/2 paged masters] in
  partition/stage12_paged.py) ``seed``s the initial masters as it flattens each parameter
  group, chunk by chunk into a spill store homed on NVMe (no full fp32 shard in host memory, ever); the
  optimizer's constructor registers each piece's master from ``read`` and then ``adopt``s
  the handle, which closes the spill (its files are deleted);
- from then on ``read`` / ``write`` go to the optimizer's pieces (``read_local`` /
  ``write_local_range`` of kind "fp32"): the partitioner's ``write_back`` (a
  GatheredParameters modifier) and its republish after a checkpoint load use them;
- the step calls ``publish`` with each updated master piece while it is in the window: the
  partitioner casts it into the 16-bit shards (stage 3) or its slices of the 16-bit replica
  (stages 1 and 2) there (per piece, no full host master);
- ``stale``: the masters were written from outside the step (checkpoint load): the next
  ``publish_params`` republishes every piece from the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from zeroio.errors import ConfigError
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats

SPILL_CHUNK_ELEMS = 1 << 22
"""Elements per chunk of the initial masters' spill (16 MiB of fp32)."""


class PagedMasters:
    """See [Note: paged masters]. ``numel``: this rank's master elements (all groups)."""

    def __init__(self, numel: int, dtype: torch.dtype, *, tiering, aio, nvme_path: str | None,
                 rank: int, backend=None, transfers: TierStats | None = None):
        """``transfers``: the partitioner's host <-> device copy stats (masters seeded from
        device parameters cross once, at construction)."""
        from zeroio.tiering import PolicyKind, TieredStore

        self.numel, self.dtype, self.transfers = numel, dtype, transfers
        self.publish: Callable[[int, int, torch.Tensor], None] | None = None
        """The partitioner's per-piece publication: (group, local start, master values)."""
        self.stale = False
        self._owner = None
        self._chunks: dict[int, list[tuple[int, int, str]]] = {}
        if nvme_path is None and backend is None:
            raise ConfigError('offload_optimizer.device is "nvme" but no nvme_path is set',
                              key="zero_optimization.offload_optimizer.nvme_path")
        path = None if nvme_path is None else os.path.join(str(nvme_path),
                                                           f"zeroio-masters-init-rank{rank}")
        self._path = path
        if path is not None:
            from zeroio.io import swapdir

            swapdir.make_private_dirs(path)
        total = numel * dtype.itemsize
        chunk = SPILL_CHUNK_ELEMS * dtype.itemsize
        self._spill = TieredStore(tiering, aio, nvme_path=path, backend=backend,
                                  gpu_budget_bytes=0, cpu_budget_bytes=2 * chunk,
                                  nvme_budget_bytes=max(total, chunk), prefetch_depth=0,
                                  policy=PolicyKind.FIFO)

    def seed(self, group: int, lo: int, values: torch.Tensor) -> None:
        """The initial masters of elements [lo, lo + len(values)) of ``group`` (construction,
        before ``adopt``): written to the spill's NVMe homes chunk by chunk."""
        from zeroio.tiering import Tier

        for at in range(0, values.numel(), SPILL_CHUNK_ELEMS):
            n = min(SPILL_CHUNK_ELEMS, values.numel() - at)
            name = f"master.g{group}.o{lo + at}"
            self._spill.register(name, (n,), self.dtype, home=Tier.NVME,
                                 init=Copies(self.transfers).to(values.narrow(0, at, n), "cpu",
                                                                 dtype=self.dtype))
            self._chunks.setdefault(group, []).append((lo + at, n, name))

    def read(self, group: int, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of ``group``'s masters, as a new host tensor."""
        if self._owner is not None:
            return self._owner.read_local(group, "fp32", lo, n)
        from zeroio.tiering import Tier

        out = torch.zeros(n, dtype=self.dtype)  # padding no chunk covers reads as zeros
        for start, count, name in self._chunks.get(group, ()):
            a, b = max(lo, start), min(lo + n, start + count)
            if a >= b:
                continue
            t = self._spill.acquire(name, Tier.CPU)
            try:
                out.narrow(0, a - lo, b - a).copy_(t.narrow(0, a - start, b - a))
            finally:
                self._spill.release(name, Tier.CPU)
        return out

    def write(self, group: int, lo: int, values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of ``group``'s masters (after ``adopt``)."""
        if self._owner is None:
            raise RuntimeError("PagedMasters.write before the optimizer adopted the masters")
        self._owner.write_local_range(group, "fp32", lo, values)

    def adopt(self, owner) -> None:
        """The optimizer holds every piece's master now (``owner``: its ``read_local`` and
        ``write_local_range`` serve kind "fp32"); the spill is deleted."""
        self._owner = owner
        self._chunks = {}
        self._close_spill()

    def close(self) -> None:
        if self._owner is None:
            self._close_spill()

    def _close_spill(self) -> None:
        """Close the spill store (its swap folder goes) and the folder made for it."""
        self._spill.close()
        if self._path is not None:
            from zeroio.io import swapdir

            swapdir.remove_if_empty(self._path)

    def spill_stats(self) -> dict:
        return self._spill.stats()


__all__ = ["PagedMasters", "SPILL_CHUNK_ELEMS"]
