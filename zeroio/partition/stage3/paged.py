"""Stage 3 with masters paged through NVMe: ``PagedMasters3`` holds these methods of
``Stage3Partitioner`` (partitioner.py), whose state they use ([Note: paged masters] in
shard/paged.py, [Note: where the masters live] in optim/swap.py).

Whether the masters page is decided once, from this rank's shard size (``_masters_page``,
before any store is built); the handle, which builds the optimizer's store and cuts its
pieces, once each optimizer group's host length is known (``_paged_masters``, from
``_build_shards``). The step publishes each updated master piece into the 16-bit shards it
overlaps (``_publish_piece``: a bisect over the group's host pieces, so a step is linear in
its pieces); after a write from outside the step, every piece is republished first.
"""

from __future__ import annotations

import bisect

import torch

from zeroio.config.zero import masters_paged
from zeroio.dtypes import DTYPES
from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm
from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.partition.stage3.store import DeviceShards
from zeroio.partition.stage3.twin import Side
from zeroio.shard.paged import PagedMasters, PieceCut
from zeroio.shard.paged_grads import PagedGrads


class PagedMasters3:
    """The paged-masters side of ``Stage3Partitioner`` (module doc); mixed into it."""

    def _masters_page(self, settings: Stage3Settings) -> bool:
        """Whether the masters page through NVMe (decided once, from this rank's shard size:
        ``masters_paged``)."""
        # the padded shard: the same on every rank, so every rank decides alike
        numel = sum(gp.shard_numel for gp in self.plan.groups)
        if not settings.nvme_optimizer or not masters_paged(
                settings.masters, host_numel=numel,
                master_bytes=DTYPES[settings.master_dtype].itemsize,
                state_bytes=DTYPES[settings.state_dtype].itemsize,
                cpu_budget_bytes=settings.tiering.cpu_budget_bytes):
            return False
        if settings.params_from_master and settings.params_from_master_forced:
            raise ConfigError(
                "zero_optimization.tiering.params_from_master = true, but the masters page "
                f"through NVMe (offload_optimizer.masters {settings.masters!r}: tiering."
                f"cpu_budget_bytes {settings.tiering.cpu_budget_bytes} cannot hold this rank's "
                f"{numel} elements of masters and moments): the gathers would read them from "
                'disk; set params_from_master to "auto" or false, or offload_optimizer.masters '
                'to "host"', key="zero_optimization.tiering.params_from_master")
        return True

    def _paged_masters(self, host_numels: list[int]) -> PagedMasters:
        """The masters' handle and the optimizer's store (``host_numels``: each optimizer
        group's host shard length)."""
        s = self.settings
        mdt, sdt = DTYPES[s.master_dtype], DTYPES[s.state_dtype]
        cut = PieceCut.for_paged(offload=s.optimizer_offload, tiering=s.tiering,
                                 master_itemsize=mdt.itemsize, state_itemsize=sdt.itemsize)
        return PagedMasters(dict(enumerate(host_numels)), mdt, cut=cut,
                            offload=s.optimizer_offload, tiering=s.tiering, aio=s.aio,
                            rank=comm.rank(), state_dtype=sdt, transfers=self.transfers)

    def _paged_grads(self) -> PagedGrads:
        """The host gradient pieces in the optimizer's store ([Note: paged gradients] in
        shard/paged_grads.py): every host piece's landing range, per optimizer group."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for refs in self._pieces.values():
            for r in refs:
                if r.side is Side.HOST:
                    ranges.setdefault(r.piece.opt_group, []).append(
                        (r.base, r.piece.hi - r.piece.lo))
        return PagedGrads(self.paged.store, self.paged.pieces, ranges,
                          dtype=self.host_grad_dtype, transfers=self.transfers)

    def _index_host_refs(self, by_group: dict, n_opt_groups: int) -> None:
        """Per optimizer group, its host pieces sorted by base (``_publish_piece``'s bisect)."""
        host = sorted((r.piece.opt_group, r.base, gi, r) for gi, refs in by_group.items()
                      for r in refs if r.side is Side.HOST)
        self._host_refs = {og: ([b for o, b, _, _ in host if o == og],
                                [(gi, r) for o, _, gi, r in host if o == og])
                           for og in range(n_opt_groups)}

    def _publish_piece(self, og: int, lo: int, values: torch.Tensor) -> None:
        """Host masters [lo, lo + len(values)) of optimizer group ``og``, updated and still in
        the optimizer's window, into the 16-bit shards they belong to ([Note: paged
        masters] in shard/paged.py)."""
        hi = lo + values.numel()
        if isinstance(self.store, DeviceShards) and self.device.type == "cuda":
            # the window's pinned buffer is reused as soon as the piece is put back: the copy
            # up must not read it asynchronously (a pageable 16-bit copy is staged at once)
            values = values.to(self.dtype, copy=True)
        bases, refs = self._host_refs[og]
        k = max(0, bisect.bisect_right(bases, lo) - 1)
        while k < len(refs) and bases[k] < hi:  # the refs overlapping [lo, hi), in order
            gi, ref = refs[k]
            a, b = max(lo, ref.base), min(hi, ref.base + ref.piece.hi - ref.piece.lo)
            if a < b:
                self.pgroups[gi].update_shard(ref.piece.lo + a - ref.base,
                                              values.narrow(0, a - lo, b - a))
            k += 1

    def _republish_paged(self) -> None:
        """After the step (published per piece already): re-gather the gathered groups; after
        a write from outside the step (checkpoint load), every piece republished first."""
        if self.paged.stale:
            step = self.settings.step_chunk_numel
            for og, sg in enumerate(self._sides[Side.HOST]):
                for lo in range(0, sg.padded_numel, step):
                    n = min(step, sg.padded_numel - lo)
                    self._publish_piece(og, lo, self.paged.read(og, lo, n))
            self.paged.stale = False
        for g in self.pgroups:
            g.refresh()
