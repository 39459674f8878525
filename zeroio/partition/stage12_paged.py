"""Stage 1/2 masters, initial values and paging through NVMe: ``PagedPublish12`` holds these
methods of ``Stage12Partitioner`` (stage12.py), whose state they use.

[Note: stage 1/2 paged masters]
With ``offload_optimizer.device`` nvme and ``offload_optimizer.masters`` nvme (or "auto" when
``tiering.cpu_budget_bytes`` cannot keep this rank's masters and gradient shard in three
quarters of it: ``masters_paged`` in config/zero.py) the host ShardGroups' ``master`` is a meta tensor and the
values live in the NVMe optimizer's store beside the moments, as at stage 3 ([Note: paged
masters] in shard/paged.py). At stages 1 and 2 every rank keeps the whole 16-bit replica in
the flat parameter buffer, and a rank's local shard is its slices of the buckets, so:

- construction seeds each parameter segment's original values into ``PagedMasters``, which
  writes each swap piece to its NVMe home once it is whole (no fp32 shard in host memory);
- the step publishes each updated master piece, while it is in the optimizer's window,
  into this rank's slices of the buckets it overlaps (a cast copy into ``params``, no
  collective inside the sweep; on CUDA the piece is cast on the host first, since the
  window's buffer is reused once the piece is put back); ``stage_range`` has nothing left
  to do;
- ``publish_params(staged=True)`` then all-gathers every bucket as with host masters;
  without ``staged`` (a checkpoint load) or after the masters were written from outside the
  step (``PagedMasters.stale``), every rank first republishes its slices from the store,
  ``STEP_CHUNK_NUMEL`` elements at a time.

"auto" weighs the budget against the host shard's state only (the 16-bit replica and its
gradient buffer live on the GPU). Not with ``offload_optimizer.ratio`` < 1 (refused with
``device: nvme`` at these stages) nor a rule other than Adam(W) (``masters_paging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from zeroio.config.zero import masters_paged
from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm
from zeroio.shard.paged import PagedMasters, PieceCut
from zeroio.tiering.copies import Copies


@dataclass(frozen=True)
class MastersPaging:
    """What the partitioner needs to page its masters (engine_build passes it with
    ``offload_optimizer.device`` nvme): ``place``, ``offload_optimizer.masters`` as
    ``masters_place`` resolved it; ``tiering``, the resolved tiering policy (its
    ``cpu_budget_bytes`` decides "auto"); ``aio``, the I/O engine's block; ``offload``, the
    resolved ``offload_optimizer`` policy (the pieces' cut and ``nvme_path``, where the
    initial masters are written)."""

    place: str
    tiering: object
    aio: object
    offload: object


def masters_paging(cfg, policies, rule: str) -> MastersPaging:
    """The ``MastersPaging`` of an engine with ``offload_optimizer.device`` nvme at stage 1 or
    2 (``policies``: its resolved policies; ``rule``: the optimizer's). Only Adam(W) pages
    its masters: "nvme" with another rule is a ConfigError naming the key, "auto" is host."""
    place = policies.optimizer.masters
    if rule != "adam" and place != "host":
        if place == "nvme":
            raise ConfigError(f'zero_optimization.offload_optimizer.masters = "nvme" with the '
                              f"{rule} optimizer: only Adam(W) pages its masters through NVMe; "
                              'set it to "host" or "auto"',
                              key="zero_optimization.offload_optimizer.masters")
        place = "host"
    return MastersPaging(place=place, tiering=policies.tiering, aio=cfg.aio,
                         offload=policies.optimizer)


class PagedPublish12:
    """The paged-masters side of ``Stage12Partitioner`` (module doc); mixed into it."""

    paged: PagedMasters | None = None

    def _master_home(self, host_numels: list[int], split: bool):
        """``empty(n)`` of the host ShardGroups' masters (``host_numels``: each group's local
        length): host memory, or a meta tensor when they page (``self.paged`` is set here)."""
        self.paged = self._paged_masters(host_numels, split, self._paging)
        if self.paged is None:
            return partial(self.home.empty, dtype=self.master_dtype)
        return partial(torch.empty, dtype=self.master_dtype, device="meta")

    def _close_paged(self) -> None:
        if self.paged is not None:
            self.paged.close()

    def _paged_masters(self, host_numels: list[int], split: bool,
                       paging) -> PagedMasters | None:
        """The masters' handle (and the optimizer's store) when they page (``paging``: the
        engine's ``MastersPaging``, or None), decided from this rank's local shard size, the
        same on every rank."""
        if paging is None or split or not self._nvme_optimizer or not masters_paged(
                paging.place, host_numel=sum(host_numels),
                master_bytes=self.master_dtype.itemsize, state_bytes=self._state_dtype.itemsize,
                cpu_budget_bytes=paging.tiering.cpu_budget_bytes):
            return None
        cut = PieceCut.for_paged(offload=paging.offload, tiering=paging.tiering,
                                 master_itemsize=self.master_dtype.itemsize,
                                 state_itemsize=self._state_dtype.itemsize)
        paged = PagedMasters(dict(enumerate(host_numels)), self.master_dtype, cut=cut,
                             offload=paging.offload, tiering=paging.tiering, aio=paging.aio,
                             rank=comm.rank(), state_dtype=self._state_dtype,
                             transfers=self.transfers)
        paged.publish = self._publish_piece
        return paged

    def _initial_masters(self, gi: int, buckets) -> None:
        """Group ``gi``'s masters from the parameters' original (full precision) values,
        before the 16-bit cast: into the ShardGroups, or seeded into the spill when paged."""
        for b in buckets:
            segs = b.my_segments(self.rank, self.world, self._local_base[b.index])
            for s in b.slots:
                flat = s.param.detach().reshape(-1)
                for seg in segs:
                    if not s.global_offset <= seg.global_offset < s.global_offset + s.numel:
                        continue
                    src = flat.narrow(0, seg.global_offset - s.global_offset, seg.numel)
                    if self.paged is not None:
                        self.paged.seed(gi, seg.local_offset, src)
                        continue
                    for off, dst in self._parts(gi, "master", seg.local_offset, seg.numel):
                        Copies(self.transfers).into(dst, src.narrow(0, off, dst.numel()))

    def _publish_piece(self, gi: int, lo: int, values: torch.Tensor) -> None:
        """Masters [lo, lo + len(values)) of group ``gi`` (local offsets), updated and still in
        the optimizer's window, into this rank's slices of the 16-bit buffer."""
        if self.device.type == "cuda":  # the window's buffer is reused once the piece is put
            values = values.to(self._compute_dtype, copy=True)  # back: no async read of it
        hi = lo + values.numel()
        for b in self.layout.group_buckets(gi):
            lb, size = self._local_base[b.index], b.slice_numel(self.world)
            a, z = max(lo, lb), min(hi, lb + size)
            if a < z:
                dst = self.params.narrow(0, b.start + self.rank * size + a - lb, z - a)
                Copies(self.transfers).into(dst, values.narrow(0, a - lo, z - a))

    def _republish_paged(self, step: int) -> None:
        """Every local slice from the store, ``step`` elements at a time."""
        for gi, sg in enumerate(self._host):
            for lo in range(0, sg.padded_numel, step):
                n = min(step, sg.padded_numel - lo)
                self._publish_piece(gi, lo, self.paged.read(gi, lo, n))
        self.paged.stale = False
