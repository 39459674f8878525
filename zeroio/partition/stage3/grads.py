"""Where a group's reduced gradient lands: this rank's ``ShardGroup.grad`` pieces (fp32, or the
compute dtype on the host: [Note: 16-bit host gradients at stage 3]).

[Note: landing reduced gradients]
A reduced bucket is consumed on the comm stream right after its
reduce-scatter, while backward goes on (the stage-2 design, stage12.py
[Note: gradient flow]):

- the first write of a group in an accumulation *copies* the scaled slice
  straight into ``ShardGroup.grad`` with one ``non_blocking`` copy per piece:
  with a pinned host home that is one asynchronous D2H DMA into memory
  allocated once, with no host wait and no fresh host tensor (a pageable
  ``.to("cpu")`` per group blocked the hook on the copy and page-faulted a
  new 200+ MB buffer per layer per step);
- a later write in the same accumulation (gradient accumulation, or a group
  reduced twice by reentrant checkpointing) must *add*: on the same device it
  adds in place; to a host home it copies into one of a few pinned fp32
  staging buffers (allocated once, reused every step) and a worker thread adds
  it on the host while the backward goes on; ``settle``, after the single host
  wait of the backward, waits for the last adds ([Note: bounded staging] in
  partition/landing.py);
- ``zero_grad`` only forgets which groups were written; ``settle`` at the
  boundary zeroes the pieces of groups that got no gradient at all, so the
  5+ GB memset of the whole gradient per step is gone (``ShardGroup.grad`` is
  only defined after ``finalize_gradients(boundary=True)``, see base.py);
- copies to host memory run on the ``d2h`` stream ([Note: stage-3 streams]),
  ordered after the consumption on ``comm``, so the gathers queued on ``comm``
  after them (the backward's next groups) never wait for a gradient to cross
  PCIe; ``settle`` waits on ``d2h``;
- [Note: norm while consuming]: when a write is the group's only one of the
  accumulation and happens at the boundary, its squared norm is taken on the
  device right there, so the step does not re-read gigabytes of host
  gradient (let alone the float64 copy of it that it used to make).

[Note: 16-bit host gradients at stage 3]
As at stages 1/2 (stage12.py, [Note: 16-bit host gradients]): when the
host side is stepped by the one-pass CPU Adam (optim/cpu_adam.py), the
compute dtype is 16-bit and nothing is accumulated on the host
(``gradient_accumulation_steps`` 1, or above it with the accumulation on the
device tier: the averaged fp32 pieces are summed in its fp32 buffer on the
comm stream and the boundary casts the sum on ``d2h``, [Note: accumulation on
the device tier] in tiering/device_accum.py), the host gradient shard is kept in the
compute dtype; ``host_grad_dtype`` in shard/host_grads.py decides, for every stage
(the partitioner asks it at construction, zeroio.estimate asks it to plan). The
kernel upcasts the gradient in registers, which is exact, so the host reads
2 bytes per element instead of 4, half the bytes cross PCIe and the host
gradient shard takes half the memory (1.364B: 5.46 -> 2.73 GB per step
device -> host; 13B at ratio 1: 52 -> 26 GB of host memory).

Unlike stages 1/2, the bucket is reduced in fp32 here (``ParamGroup`` stages
gradients in fp32), so the 16-bit values are made on the device: the piece is
averaged (the 1/world ``scale``) and its squared norm taken in fp32 exactly
as before, then cast on the ``d2h`` stream and copied. The 1/world is not
folded into the optimizer's grad_scale (its ``grad_divisor`` stays 1): the
cast is a pass of its own anyway, and an unaveraged fp16 sum over ranks could
overflow where the average cannot. Rounding the average to 16 bits is the
one difference to fp32 host gradients; at world 1 there is none (every fp32
value of the bucket is a sum of one bf16/fp16 gradient, already in the compute
dtype), so the step is bit-equal. With offload_optimizer.ratio < 1 only the
host side changes: the device side keeps fp32 gradients on the GPU. A second
write of a group in one accumulation (a group reduced twice in one backward)
still goes through the fp32 staging buffer and is added on the host, rounded
to 16 bits once more. With resident chunks of the step assist, a chunk's slice of
the 16-bit gradient lands in its GPU buffer instead, on the comm stream, with the
same cast ([Note: resident gradients] in shard/assist.py); a second write adds there.
offload_optimizer nvme follows the same rule: its swapper steps each
swapped piece with the one-pass kernel, reading the 16-bit gradient (optim/swap.py, [Note: the
gradient a piece reads]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroio.partition.base import ShardGroup
from zeroio.partition.landing import StagedAdds, land
from zeroio.partition.stage3.streams import keep_for, on, record, wait_stream
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats


@dataclass(frozen=True, kw_only=True)
class Landing:
    """One piece of a group's shard and the place of its gradient (fp32, or 16-bit on the host
    side: [Note: 16-bit host gradients at stage 3])."""

    lo: int
    """Start inside the rank's shard of the group."""
    numel: int
    target: int
    """Index of the ShardGroup (in ``GradLanding.groups``) whose gradient holds it: the optimizer
    group, or with twin placement (twin.py) that group's host or device side."""
    base: int
    """Start inside ``ShardGroup.grad`` of ``target``."""


class GradLanding:
    """Consumes reduced buckets into ``ShardGroup.grad`` (see the note above)."""

    def __init__(self, groups: list[ShardGroup], pieces: dict[int, list[Landing]],
                 device: torch.device, pin: bool, transfers: TierStats | None = None,
                 d2h: torch.cuda.Stream | None = None, paged=None):
        """``paged``: the ``PagedGrads`` of the groups whose ``grad`` is a meta tensor ([Note:
        paged gradients] in shard/paged_grads.py): their landings are cut at its piece
        boundaries and land in its windows."""
        self.groups = groups
        self.d2h = d2h  # copies into host memory (see the note); None on CPU
        self.transfers = transfers  # D2H bytes and host waits (engine.stats)
        self.paged = paged
        self.pieces = pieces
        self._parts = pieces if paged is None else {
            gi: [part for ld in lds for part in self._cut(ld)] for gi, lds in pieces.items()}
        """What each group lands as: ``pieces``, the paged ones cut at piece boundaries (the
        norm is still taken over ``pieces``: the same sums, bit for bit, as unpaged)."""
        self.device = device
        self.pin = pin and torch.cuda.is_available()
        self._written: dict[int, int] = {}          # group -> writes this accumulation
        slot = max((sum(ld.numel for ld in lds) for lds in pieces.values()), default=0)
        self._adds = (StagedAdds(slot, pin=self.pin, transfers=transfers) if slot else None)
        """Later writes into host memory ([Note: bounded staging] in partition/landing.py)."""
        self._norm_parts: list[torch.Tensor] = []
        self._norm_valid = True
        self.router = None
        """The step assist whose resident chunks' gradients land on the GPU ([Note: resident
        gradients] in shard/assist.py; set by the partitioner), else None."""
        self.accum = None
        """The device buffers accumulating the host gradients ([Note: accumulation on the
        device tier] in tiering/device_accum.py; set by the partitioner), else None."""
        self._dirty: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Groups whose device sum has not gone to the host yet: (device, host) views."""

    @property
    def host_allocations(self) -> int:
        """Pinned staging buffers allocated so far (at most ``STAGING_SLOTS``)."""
        return len(self.held_tensors())

    def reserve_staging(self) -> None:
        """Allocate the staging buffers now (gradient accumulation will use them), so that the
        engine's host budget counts them ([Note: budgets in training] in tiering/budget.py).
        Nothing is staged, so nothing is reserved, unless a device's gradient lands in host
        memory."""
        if self._adds is not None and self.device.type == "cuda" and any(
                g.grad.device.type == "cpu" for g in self.groups):
            self._adds.reserve()

    def held_tensors(self) -> list[torch.Tensor]:
        """The staging buffers allocated so far (``engine.stats()["tiers"]``)."""
        return self._adds.held_tensors() if self._adds is not None else []

    def close(self) -> None:
        """Apply the staged adds and stop their worker thread."""
        if self._adds is not None:
            self._adds.close()
        if self.paged is not None:
            self.paged.close()

    def _cut(self, ld: Landing) -> list[Landing]:
        """``ld`` cut at the paged gradient's piece boundaries (itself when not paged)."""
        if not self._is_paged(ld):
            return [ld]
        return [Landing(lo=ld.lo + at - ld.base, numel=n, target=ld.target, base=at)
                for at, n in self.paged.split(ld.target, ld.base, ld.numel)]

    def _is_paged(self, ld: Landing) -> bool:
        return self.paged is not None and self.groups[ld.target].grad.is_meta

    def _on_host(self, ld: Landing) -> bool:
        return self._is_paged(ld) or self.groups[ld.target].grad.device.type == "cpu"

    def _dst(self, ld: Landing, first: bool = False) -> torch.Tensor:
        if self._is_paged(ld):  # a window of the optimizer's store ([Note: paged gradients])
            return self.paged.view(ld.target, ld.base, ld.numel, first=first)
        return self.groups[ld.target].grad.narrow(0, ld.base, ld.numel)

    def consume(self, gi: int, shard: torch.Tensor, scale: float, boundary: bool) -> None:
        """``shard``: the group's reduced slice (this rank's, device, fp32); runs on the comm
        stream, queueing work only."""
        shard.mul_(scale)
        writes = self._written.get(gi, 0)
        self._written[gi] = writes + 1
        if writes == 0 and boundary:
            for ld in self.pieces.get(gi, []):
                src = shard.narrow(0, ld.lo, ld.numel)
                self._norm_parts.append(torch.linalg.vector_norm(src).double().pow(2))
        else:  # accumulated over writes: the final value is only known on the host
            self._norm_valid = False
        lds = self._parts.get(gi, [])
        if self.router is not None:
            lds = self._route(lds, shard, first=writes == 0)
        flush = []
        if self.accum is not None:
            lds, flush = self._accumulate(gi, lds, shard, first=writes == 0, boundary=boundary)
        # with twin placement one group may land on both sides: device pieces on comm, host
        # pieces on d2h
        host = [ld for ld in lds if shard.is_cuda and self._on_host(ld)]
        side = self.d2h if (host or flush) and shard.is_cuda else None
        if side is not None:  # after the scaling above, on comm; see the note
            wait_stream(side, torch.cuda.current_stream(shard.device))
            keep_for(shard, side)
        staged = []
        for ld in lds:
            with on(side if ld in host else None):
                src, dst = shard.narrow(0, ld.lo, ld.numel), self._dst(ld, first=writes == 0)
                if writes == 0 and dst.dtype != src.dtype and src.is_cuda:  # [Note: 16-bit
                    # host gradients at stage 3]: cast here, allocated on this stream (d2h)
                    src = src.to(dst.dtype)
                if not land(src, dst, first=writes == 0, transfers=self.transfers):
                    staged.append(ld)  # [Note: one landing rule] in partition/landing.py
                elif writes == 0 and self._is_paged(ld):  # a full paged piece goes at once
                    self.paged.landed(ld.target, ld.base, ld.numel,
                                      after=record(side) if side is not None else None)
        with on(side):  # the boundary's sums to the host (cast there to a 16-bit host shard)
            for acc, dst in flush:
                self.accum.flush(acc, dst, self.transfers)
        if staged:
            with on(side):
                self._adds.stage([(shard.narrow(0, ld.lo, ld.numel), self._dst(ld))
                                  for ld in staged],
                                 torch.cuda.current_stream(shard.device) if shard.is_cuda
                                 else None)

    def _accumulate(self, gi: int, lds: list[Landing], shard: torch.Tensor, *, first: bool,
                    boundary: bool) -> tuple[list[Landing], list]:
        """Copy or add the pieces whose host gradient is accumulated on the device into their
        device buffer (on the current stream); the other landings, and at the boundary the
        ``(device, host)`` views whose sums go to the host now."""
        rest, done = [], []
        for ld in lds:
            dst = self._dst(ld)
            acc = self.accum.view_of(dst)
            if acc is None:
                rest.append(ld)
                continue
            src = shard.narrow(0, ld.lo, ld.numel)
            if first:
                acc.copy_(src)
            else:
                acc.add_(src)
            done.append((acc, dst))
        if boundary:
            self._dirty.pop(gi, None)
            return rest, done
        if done:
            self._dirty[gi] = done
        return rest, []

    def _route(self, lds: list[Landing], shard: torch.Tensor, first: bool) -> list[Landing]:
        """Write the slices of resident chunks with a GPU gradient buffer there (on the current
        stream, comm); the rest of ``lds``, as landings, goes on as before."""
        rest, wrote = [], False
        for ld in lds:
            dst = self._dst(ld)
            parts = ([] if dst.device.type != "cpu" or dst.dtype == torch.float32 else
                     self.router.grad_parts(ld.target, ld.base, ld.numel))
            at = 0
            for off, res in parts + [(ld.numel, None)]:  # the sentinel closes the last gap
                if res is not None and not first and not res.grad_here:
                    continue  # its first write went to the host: so does this one
                if off > at:
                    rest.append(ld if (at, off) == (0, ld.numel) else Landing(
                        lo=ld.lo + at, numel=off - at, target=ld.target, base=ld.base + at))
                if res is None:
                    break
                n = res.g16.numel()
                src = shard.narrow(0, ld.lo + off, n)
                if first:
                    res.g16.copy_(src)  # the cast the host path makes, on the device
                    res.host_grad, res.grad_here = dst.narrow(0, off, n), True
                else:
                    res.g16.add_(src)
                wrote, at = True, off + n
        if wrote and shard.is_cuda:
            self.router.grads_written(record(torch.cuda.current_stream(shard.device)))
        return rest

    def settle(self, boundary: bool, stream: torch.cuda.Stream | None) -> None:
        """After every reduction was consumed (on ``stream``; the copies to host on ``d2h``,
        which waited on ``stream`` each time): one host wait when gradients land in host
        memory, the last staged adds, and at the boundary zeros for unwritten groups."""
        if boundary and self._dirty:  # sums of groups the boundary micro step did not reach
            with on(self.d2h if stream is not None else None):
                if stream is not None:
                    wait_stream(self.d2h, stream)
                for acc, dst in (v for vs in self._dirty.values() for v in vs):
                    self.accum.flush(acc, dst, self.transfers)
            self._dirty = {}
        if stream is not None and any(g.grad.device.type == "cpu" or g.grad.is_meta
                                      for g in self.groups):
            with StallTimer(self.transfers):  # the CPU optimizer reads these bytes next
                record(self.d2h if self.d2h is not None else stream).synchronize()
        if self._adds is not None:
            self._adds.drain()
        if boundary:
            for gi, lds in self.pieces.items():
                if gi not in self._written:
                    for ld in lds:
                        if not self._is_paged(ld):  # paged: zeroed by its settle, below
                            self._dst(ld).zero_()
            if self.paged is not None:
                self.paged.settle()

    def sq_norm(self) -> torch.Tensor | None:
        """The local squared gradient norm from the parts taken while consuming, or None when
        they do not cover the final gradient (accumulation, a group written twice)."""
        if not self._norm_valid or not self._norm_parts:
            return None
        return Copies(self.transfers).host(torch.stack(self._norm_parts).sum().float())

    def reset(self) -> None:
        """New accumulation: nothing written yet (``zero_grad``)."""
        self._written = {}
        self._dirty = {}
        self._norm_parts = []
        self._norm_valid = True
        if self.paged is not None:
            self.paged.reset()
        if self.router is not None:
            self.router.forget_grads()
