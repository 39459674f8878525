"""Gradient accumulation placed on the device tier: where the accumulating gradient shard lives.

[Note: accumulation on the device tier]
With a host optimizer (offload_optimizer cpu or nvme) and ``gradient_accumulation_steps`` > 1,
stage 2 sums each micro step's reduced gradient into the host gradient shard: the first write
copies, every later one crosses PCIe into a pinned staging slot and is added on the host
([Note: bounded staging] in partition/landing.py). Where the GPU has room, the partitioner
instead keeps one buffer of the host gradient shard's size and dtype on the compute device
(``DeviceAccum``): the first micro step copies into it, later ones add into it on the GPU
(no PCIe traffic, no staging slots), and only the boundary micro step, after its add, copies
the sum into the host gradient shard (one D2H copy per step instead of one per micro step).
The adds are the same adds in the same order and dtype as the host's, so the host step reads
the same bits.

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
["gpu"]``. zeroio.estimate plans it with ``place_on_device(room=None)``: the budget alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroio.tiering.gpu_tier import RESERVE_BYTES


def cuda_room(device: torch.device) -> int | None:
    """Free bytes of ``device`` now (None: no device distinct from the host)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


DEVICE_ROOM: Callable[[torch.device], int | None] = cuda_room
"""How the partitioner reads the room (a test injects a stand-in device's)."""


def place_on_device(nbytes: int, *, budget: int | None, room: int | None,
                    plan_only: bool = False) -> bool:
    """Whether an accumulation buffer of ``nbytes`` goes on the device (module note).
    ``room``: the device's free bytes (None: no device, unless ``plan_only``: unknown, the
    budget alone decides)."""
    if nbytes <= 0 or budget == 0:
        return False
    if room is None:
        return plan_only and (budget is None or nbytes <= budget)
    if budget is None:
        return nbytes <= room // 2 - RESERVE_BYTES
    return nbytes <= min(budget, room - RESERVE_BYTES)


class DeviceAccum:
    """Device buffers that accumulate the host gradient shards (module note): one per host
    group, of its gradient's size and dtype. A fixed holder of the GPU tier."""

    def __init__(self, host_grads: list[torch.Tensor], device: torch.device):
        self.bufs = [torch.zeros(g.numel(), dtype=g.dtype, device=device) for g in host_grads]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.bufs)

    def gpu_bytes(self) -> int:
        return self.nbytes

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.bufs)


__all__ = ["DEVICE_ROOM", "DeviceAccum", "cuda_room", "place_on_device"]
