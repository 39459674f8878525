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
Stage 3 (partition/stage3/grads.py) adds on its comm stream and copies the sums on ``d2h``;
a group the boundary micro step did not reduce is copied at ``settle``.

The buffer is fp32 (``ACCUM_ELEMENT_BYTES`` per host gradient element), whatever the host
gradient's dtype: the sum over micro steps is taken in fp32. Since nothing then accumulates
on the host, the host gradient shard follows the rule of one micro step
(``device_accumulates`` of ``host_grad_dtype`` in shard/host_grads.py): with 16-bit compute
and the one-pass CPU Adam it is kept in the compute dtype, and the boundary micro step casts
the fp32 sum to it on the device (``flush``) before the copy, so the host reads 2 bytes per
element and the total is rounded to 16 bits once, as with one micro step. That is why the
placement is decided first, from the fp32 buffer's size, before the host shards are
allocated. The averaging follows one micro step's convention of the stage: stage 2 sums the
unaveraged reduced values (the 1/world folded into the optimizer's ``host_grad_divisor``,
[Note: 16-bit host gradients] in partition/stage12.py), stage 3 the averaged ones ([Note:
16-bit host gradients at stage 3]). The cast's temporary is allocated on the stream that
copies it and dropped after the copy is queued there: the caching allocator hands its block
out again only behind that stream's queued work. Otherwise (fp32 compute, or the host kernel
torch's) the host gradient is fp32 and the adds are the same adds in the same order and dtype
as the host path's, so the host step reads the same bits. With bf16 master weights the host
gradient is bf16 either way; its device sum is fp32, one rounding instead of one per add.

The placement is decided once, by the engine's placement at initialize ([Note: one
placement] in zeroio/placement.py: its estimate plans the buffer with ``planned_on_device``
from the device's free memory then, read once by ``engine_build.measured_machine``), and the
partitioner follows that decision (``accumulation_placed``'s ``decided``); a partitioner built
without an engine decides by the same rule itself. The rule (``place_on_device``), from
``zero_optimization.tiering.gpu_budget_bytes`` and the device's free memory:

- budget 0: never (the host path, as before);
- a budget in bytes: when the buffer fits both the budget and the free memory less
  ``RESERVE_BYTES``;
- "auto" (None): when it fits half of the free memory less ``RESERVE_BYTES`` (the other half
  is left to activations, as the resident chunks' "auto" leaves it).

Otherwise (and without a device distinct from the host) the host path stays. The buffer is
registered with the GPU tier as fixed state (``GpuTier.register_fixed``): it cannot be
evicted in the middle of an accumulation, so resident optimizer chunks yield to it (their
room and budget are what is left beside it), and it is counted in ``engine.stats()["tiers"]
["gpu"]``. zeroio.estimate plans it with ``planned_on_device`` (config/accum_place.py):
given the device's free memory (``device_room``: the engine's measured machine) that is the
decision; without it (``zeroio estimate``, ``zeroio plan``) an explicit budget that covers the buffer places it, and "auto"
is planned as the host path (an upper bound of host memory, the GPU row left out). A buffer
planned on the device also plans the host gradient by the rule of one micro step (16-bit
where the one-pass kernel is planned).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroio.config.accum_place import ACCUM_ELEMENT_BYTES, place_on_device
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats


def cuda_room(device: torch.device) -> int | None:
    """Free bytes of ``device`` now (None: no device distinct from the host, or no CUDA in
    this process: a preflight asked about a device it cannot see)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


DEVICE_ROOM: Callable[[torch.device], int | None] = cuda_room
"""How the partitioner reads the room (a test injects a stand-in device's)."""


def accumulation_placed(*, accumulates: bool, host_numel: int, device: torch.device,
                        budget: int | None, decided: bool | None = None) -> bool:
    """Whether a partitioner that ``accumulates`` ``host_numel`` host gradient elements sums
    them on ``device``: as ``decided`` (the engine's placement: ``Placement.
    accumulation_on_device``), or where nobody decided (a partitioner built alone) by
    ``place_on_device`` of the fp32 buffer with the room ``DEVICE_ROOM`` reads now. Asked
    before the host gradient's dtype, which follows it (module note)."""
    if not accumulates or host_numel <= 0:
        return False
    if decided is not None:
        return decided
    return place_on_device(ACCUM_ELEMENT_BYTES * host_numel, budget=budget,
                           room=DEVICE_ROOM(device))


def gradient_placed(*, streams: bool, host_numel: int, accumulated: bool,
                    accumulates_on_host: bool, home_bytes: int, device: torch.device,
                    budget: int | None, decided: bool | None = None) -> bool:
    """Whether the host optimizer's gradient of ``host_numel`` elements stays on ``device``
    and the host step reads it through a window ([Note: the gradient's home] in
    config/accum_place.py): as ``decided`` (the engine's placement: ``Placement.
    gradient_on_device``), or, decided by nobody, by that rule: where the host shard is
    stepped chunk by chunk (``streams``), always when the accumulation buffer is placed
    (``accumulated``: it is the home), never when micro steps are summed on the host, else
    when a device shard of ``home_bytes`` per element fits (``place_on_device``)."""
    if not streams or host_numel <= 0:
        return False
    if decided is not None:
        return decided
    if accumulated:
        return True
    if accumulates_on_host:
        return False
    return place_on_device(home_bytes * host_numel, budget=budget, room=DEVICE_ROOM(device))


def accumulation_on_device(*, placed: bool, host_grads: list[torch.Tensor],
                           device: torch.device) -> DeviceAccum | None:
    """The ``DeviceAccum`` of ``host_grads`` (host memory) where ``accumulation_placed``
    ``placed`` it, else None: the host path."""
    grads = [g for g in host_grads if g.numel() and g.device.type == "cpu"]
    return DeviceAccum(grads, device) if placed and grads else None


class DeviceAccum:
    """Device buffers that accumulate the host gradient shards (module note): one per host
    gradient tensor, of its size, in fp32. A fixed holder of the GPU tier."""

    def __init__(self, host_grads: list[torch.Tensor], device: torch.device):
        self.host = list(host_grads)
        self.bufs = [torch.zeros(g.numel(), dtype=torch.float32, device=device)
                     for g in host_grads]
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
        added on the device later (a 16-bit ``src`` is upcast exactly); on the ``last`` (the
        boundary) the sum goes to ``host`` (``flush``)."""
        if first:
            acc.copy_(src)
        else:
            acc.add_(src)
        if last:
            self.flush(acc, host, transfers)

    @staticmethod
    def flush(acc: torch.Tensor, host: torch.Tensor, transfers: TierStats | None) -> None:
        """The fp32 sum ``acc`` into ``host`` on the current stream: cast to a 16-bit host
        gradient's dtype there first (one rounding; the temporary is allocated on this stream
        and only reused behind its copy: module note), then one ``non_blocking`` copy (the
        caller's host wait of the backward covers it)."""
        out = acc if acc.dtype == host.dtype else acc.to(host.dtype)
        Copies(transfers).into(host, out, non_blocking=True)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.bufs)


__all__ = ["DEVICE_ROOM", "DeviceAccum", "accumulation_on_device", "accumulation_placed",
           "cuda_room", "gradient_placed"]
