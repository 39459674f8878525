"""Where the accumulating gradient shard lives, decided without torch: the rule
``DeviceAccum`` is placed by ([Note: accumulation on the device tier] in
tiering/device_accum.py) and the estimate's rows of it (zeroio.estimate, zeroio.plan).

The estimate (module doc, 2.) plans, with ``gradient_accumulation_steps`` > 1 and gradients
on the host at stages 2 and 3, either the host path: ``STAGING_SLOTS`` pinned fp32 buffers
of one group's slice (4 x 3 x G / N; stage 2: of one gradient piece), at most the offloaded
elements, that later writes cross PCIe in before the host adds them (partition/landing.py,
[Note: bounded staging]); or, where ``planned_on_device`` places it, one fp32 buffer of the
offloaded elements on the GPU (4 x H) and a host gradient by the rule of one micro step
(16-bit where the one-pass CPU Adam is planned). With the device's free bytes
(``estimate_memory``'s ``device_room``: the engine's measured machine, or the planner's
usable GPU memory) it decides as the engine will; without them (``zeroio estimate``) only a
``tiering.gpu_budget_bytes`` that covers the buffer places it, "auto" being planned as the
host path (an upper bound of host memory).

[Note: the gradient's home]
With ``offload_optimizer.device`` cpu and the chunked CPU Adam (Adam(W)), host memory need hold
no gradient shard at all: where the device has room, the gradient the optimizer reads stays
on the device and the host step reads it chunk by chunk through a window of ``WINDOW_SLOTS``
pinned slots of one chunk each ([Note: the gradient window] in tiering/grad_window.py). Its
home is the accumulation buffer where ``planned_on_device`` placed one (no extra device
memory: it is no longer copied to a host shard at the boundary), else (one micro step, or
stage 1, which sums its micro steps in the replicated device gradient) a device shard of the
host gradient's dtype and size, placed by the same ``place_on_device`` rule from its bytes.
Host memory then holds the optimizer state and the window: its floor. Where the device has
no room for it (or ``tiering.gpu_budget_bytes`` is 0, DeepSpeed's placement), or another
optimizer steps the host shard whole (Lamb, a client optimizer, the NVMe swapper), the
gradient lives in host memory as before. ``gradient_on_device`` is the rule;
``zeroio.estimate`` plans with it and the partitioners build what the engine's placement
decided with it."""

from __future__ import annotations

import math
from collections.abc import Callable

ACCUM_RESERVE_BYTES = 2 << 30
"""Device bytes left free beyond the buffer (the GPU tier's ``RESERVE_BYTES``)."""
ACCUM_ROW = "gradient accumulation buffer (device tier)"
"""The estimate's row of the device buffer."""
ACCUM_ELEMENT_BYTES = 4
"""Bytes per host gradient element of the buffer: the sum over micro steps is taken in fp32,
whatever the host gradient's dtype (it is decided before that dtype, which follows it)."""


def place_on_device(nbytes: int, *, budget: int | None, room: int | None,
                    plan_only: bool = False) -> bool:
    """Whether an accumulation buffer of ``nbytes`` goes on the device ([Note: accumulation
    on the device tier]): never with budget 0; with a budget in bytes when it fits the budget
    and the device's free ``room`` less ``ACCUM_RESERVE_BYTES``; "auto" (None) when it fits
    half the room less the reserve. ``room`` None: no device, unless ``plan_only`` (the room
    is unknown): then only an explicit budget that covers the buffer places it, and "auto" is
    planned as the host path (an upper bound of host memory)."""
    if nbytes <= 0 or budget == 0:
        return False
    if room is None:
        return plan_only and budget is not None and nbytes <= budget
    if budget is None:
        return nbytes <= room // 2 - ACCUM_RESERVE_BYTES
    return nbytes <= min(budget, room - ACCUM_RESERVE_BYTES)


def planned_on_device(budget: int | None, room: int | None, items, *, stage: int, gas: int,
                      grad_tier: str, host: int) -> tuple[bool, int]:
    """Whether the estimate plans the accumulation of ``host`` host gradient elements per GPU
    on the device (the partitioners' rule: ``gas`` > 1 at stages 2 and 3 with host gradients,
    ``place_on_device`` of the fp32 buffer), and the accumulation steps the host gradient's
    dtype then follows (1 where it is: nothing accumulates on the host, else ``gas``).
    ``room``: the device's free bytes where the caller knows them (the preflight), less the
    GPU model states of the estimate's ``items`` so far (the engine places them before its
    partitioner decides); None plans without them (``plan_only``: "auto" is the host path)."""
    if gas <= 1 or grad_tier != "cpu" or stage not in (2, 3):
        return False, gas
    if room is not None:
        room = max(0, room - sum(i.bytes_per_gpu for i in items
                                 if i.tier == "gpu" and i.kind == "model_state"))
    on = place_on_device(ACCUM_ELEMENT_BYTES * host, budget=budget, room=room,
                         plan_only=room is None)
    return on, 1 if on else gas


WINDOW_SLOTS = 2
"""Pinned slots of the gradient window: the chunk the CPU Adam steps and the next one's copy
([Note: the gradient's home])."""
WINDOW_ROW = "gradient window (pinned; the host step reads the device gradient through it)"
"""The estimate's row of the window."""


def gradient_on_device(budget: int | None, room: int | None, items, *, stage: int, gas: int,
                       grad_tier: str, host: int, streams: bool, accumulates_on_device: bool,
                       home_bytes: int) -> bool:
    """Whether the optimizer's gradient of ``host`` host elements per GPU stays on the device
    and reaches the host step through the window ([Note: the gradient's home]). ``streams``:
    the host shard is stepped chunk by chunk by the CPU Adam (offload_optimizer cpu, Adam);
    ``accumulates_on_device``: ``planned_on_device`` placed the accumulation buffer (then it
    is the home); ``home_bytes``: bytes per element of the device shard otherwise (the host
    gradient's dtype). ``budget``, ``room``, ``items``: as ``planned_on_device``'s."""
    if not streams or grad_tier != "cpu" or host <= 0:
        return False
    if accumulates_on_device:
        return True
    if gas > 1 and stage in (2, 3):  # summed on the host: its shard is the home
        return False
    if room is not None:
        room = max(0, room - sum(i.bytes_per_gpu for i in items
                                 if i.tier == "gpu" and i.kind == "model_state"))
    return place_on_device(home_bytes * host, budget=budget, room=room, plan_only=room is None)


def window_rows(add: Callable[..., None], *, host: int, chunk: int, grad_bytes: int,
                kind: str) -> None:
    """The estimate's row of the gradient window: ``WINDOW_SLOTS`` pinned slots of one host
    step chunk (at most ``chunk`` elements, and at most the ``host`` elements) of
    ``grad_bytes`` each."""
    slot = min(chunk, host)
    add(WINDOW_ROW, "cpu", WINDOW_SLOTS * slot * grad_bytes, kind,
        f"{WINDOW_SLOTS} * min(step_chunk_numel, offloaded elements per GPU) * {grad_bytes}")


def accumulation_rows(add: Callable[..., None], *, stage: int, dtype: str, gas: int,
                      grad_tier: str, host: int, on_device: bool,
                      group: tuple[int, str], world: int, kind: str,
                      staging: tuple[int, int]) -> None:
    """The estimate's rows of a gradient accumulated for ``host`` host elements per GPU: the
    fp32 device buffer where ``planned_on_device`` placed it (``on_device``), else the host's
    pinned staging slots ([Note: bounded staging] in partition/landing.py: slots of stage 3's
    largest group slice ``group`` = (elements, its name) or of stage 2's gradient piece).
    ``staging``: (``STAGING_SLOTS``, ``GRAD_PIECE_NUMEL``) of shard/host_rule.py.
    ``add(name, tier, bytes, kind, formula)``: the estimate's. ``room``: the device's free
    bytes where measured (the running engine's placement: 0 on a CPU device), None where the
    room is unknown (a plan: ``place_on_device``'s ``plan_only``)."""
    if gas <= 1 or grad_tier != "cpu" or stage not in (2, 3):
        return
    if on_device:
        add(ACCUM_ROW, "gpu", ACCUM_ELEMENT_BYTES * host, kind,
            f"{ACCUM_ELEMENT_BYTES} * offloaded elements per GPU")
        return
    if stage == 3 and dtype == "fp32":
        return
    (slots, piece), (grp, gname) = staging, group
    slot, of = ((min(math.ceil(grp / world), host), f"min({gname}, Psi) / N") if stage == 3
                else (min(piece, host), f"min({piece}, Psi / N)"))
    add("gradient accumulation staging (pinned fp32)", "cpu", 4 * slots * slot, kind,
        f"4 * {slots} * {of}")


__all__ = ["ACCUM_ELEMENT_BYTES", "ACCUM_RESERVE_BYTES", "ACCUM_ROW", "WINDOW_ROW", "WINDOW_SLOTS",
           "accumulation_rows", "gradient_on_device", "place_on_device", "planned_on_device",
           "window_rows"]
