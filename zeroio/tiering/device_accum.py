"""Gradient accumulation placed on the device tier: where the accumulating gradient shard lives.

[Note: accumulation on the device tier]
With a host optimizer (offload_optimizer cpu or nvme) and ``gradient_accumulation_steps`` > 1,
stages 2 and 3 sum each micro step's reduced gradient into the host gradient shard: the first
write copies, every later one crosses PCIe into a pinned staging slot and is added on the host
([Note: bounded staging] in partition/landing.py). Where the GPU has room, the partitioner
instead keeps one buffer of the host gradient shard's size and dtype on the compute device
(``DeviceAccum``): the first micro step copies into it, later ones add into it on the GPU
(no PCIe traffic, no staging slots), and only the boundary micro step, after its add, copies
the sum into the host gradient shard (one D2H copy per step instead of one per micro step).
The adds are the same adds in the same order and dtype as the host's, so the host step reads
the same bits. Stage 3 (partition/stage3/grads.py) adds on its comm stream and copies the
sums on ``d2h``; a group the boundary micro step did not reduce is copied at ``settle``. The
host gradient shard keeps its fp32 (master dtype) size: the step still reads it from host
memory.

The placement is decided once, at construction (``place_on_device``), from
``zero_optimization.tiering.gpu_budget_bytes`` and the device's free memory then:

- budget 0: never (the host path, as before);
- a budget in bytes: when the buffer fits both the budget and the free memory less
  ``RESERVE_BYTES``;
- "auto" (None): when it fits half of the free memory less ``RESERVE_BYTES`` (the other half
  is left to activations, as the resident chunks' "auto" leaves it).

Otherwise (and without a device distinct from the host) the host path stays. The buffer is
registered with the GPU tier as fixed state (``GpuTier.register_fixed``): it cannot be
evicted in the middle of an accumulation, so resident optimizer chunks yield to it (their
room and budget are what is left beside it), and it is counted in ``engine.stats()["tiers"]
["gpu"]``. zeroio.estimate plans it with ``place_on_device(room=None, plan_only=True)``:
the device's free memory is unknown there, so an explicit budget that covers the buffer
places it (a GPU row instead of the host's staging slots), and "auto" is planned as the host
path (an upper bound of host memory, the GPU row left out).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroio.config.accum_place import place_on_device
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


def cuda_room(device: torch.device) -> int | None:
    """Free bytes of ``device`` now (None: no device distinct from the host)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


DEVICE_ROOM: Callable[[torch.device], int | None] = cuda_room
"""How the partitioner reads the room (a test injects a stand-in device's)."""


def accumulation_on_device(*, accumulates: bool, host_grads: list[torch.Tensor],
                           device: torch.device, budget: int | None) -> DeviceAccum | None:
    """The ``DeviceAccum`` of ``host_grads`` (host memory) where a partitioner that
    ``accumulates`` them places it on ``device`` (``place_on_device`` with the room
    ``DEVICE_ROOM`` reads), else None: the host path."""
    grads = [g for g in host_grads if g.numel() and g.device.type == "cpu"]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    if not accumulates or not place_on_device(nbytes, budget=budget, room=DEVICE_ROOM(device)):
        return None
    return DeviceAccum(grads, device)


class DeviceAccum:
    """Device buffers that accumulate the host gradient shards (module note): one per host
    gradient tensor, of its size and dtype. A fixed holder of the GPU tier."""

    def __init__(self, host_grads: list[torch.Tensor], device: torch.device):
        self.host = list(host_grads)
        self.bufs = [torch.zeros(g.numel(), dtype=g.dtype, device=device) for g in host_grads]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.bufs)
        if device.type == "cuda":  # the zeros are written before a side stream first copies in
            torch.cuda.current_stream(device).synchronize()

    def gpu_bytes(self) -> int:
        return self.nbytes

    def view_of(self, dst: torch.Tensor) -> torch.Tensor | None:
        """The device buffer's view standing for ``dst`` (a contiguous view of one of the host
        gradients), or None where ``dst`` is none of them (the device side of a ratio)."""
        ptr = dst.data_ptr()
        for host, buf in zip(self.host, self.bufs, strict=True):
            lo = (ptr - host.data_ptr()) // host.element_size()
            if host.dtype == dst.dtype and 0 <= lo and lo + dst.numel() <= host.numel() and \
                    dst.device == host.device:
                return buf.narrow(0, lo, dst.numel())
        return None

    def land(self, src: torch.Tensor, acc: torch.Tensor, host: torch.Tensor, *, first: bool,
             last: bool, transfers: TierStats | None) -> None:
        """One micro step's ``src`` into ``acc`` (``view_of(host)``): copied on the first,
        added on the device later; on the ``last`` (the boundary) the sum goes to ``host``
        (one ``non_blocking`` copy: the caller's host wait of the backward covers it)."""
        if first:
            acc.copy_(src)
        else:
            acc.add_(src)
        if last:
            Copies(transfers).into(host, acc, non_blocking=True)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.bufs)


__all__ = ["DEVICE_ROOM", "DeviceAccum", "accumulation_on_device", "cuda_room"]
