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
host path (an upper bound of host memory)."""

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


__all__ = ["ACCUM_ELEMENT_BYTES", "ACCUM_RESERVE_BYTES", "ACCUM_ROW", "accumulation_rows",
           "place_on_device", "planned_on_device"]
