"""Where the accumulating gradient shard lives, decided without torch: the rule
``DeviceAccum`` is placed by ([Note: accumulation on the device tier] in
tiering/device_accum.py) and the estimate's rows of it (zeroio.estimate, zeroio.plan)."""

from __future__ import annotations

import math
from collections.abc import Callable

ACCUM_RESERVE_BYTES = 2 << 30
"""Device bytes left free beyond the buffer (the GPU tier's ``RESERVE_BYTES``)."""
ACCUM_ROW = "gradient accumulation buffer (device tier)"
"""The estimate's row of the device buffer."""


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


def accumulation_rows(add: Callable[..., None], *, stage: int, dtype: str, gas: int,
                      grad_tier: str, host: int, grad_bytes: int, budget: int | None,
                      group: tuple[int, str], world: int, kind: str,
                      staging: tuple[int, int], room: int | None = None) -> None:
    """The estimate's rows of a gradient accumulated for ``host`` host elements per GPU of
    ``grad_bytes`` each: the device buffer where ``place_on_device`` plans it, else the host's
    pinned staging slots ([Note: bounded staging] in partition/landing.py: slots of stage 3's
    largest group slice ``group`` = (elements, its name) or of stage 2's gradient piece).
    ``staging``: (``STAGING_SLOTS``, ``GRAD_PIECE_NUMEL``) of shard/host_rule.py.
    ``add(name, tier, bytes, kind, formula)``: the estimate's. ``room``: the device's free
    bytes where measured (the running engine's placement: 0 on a CPU device), None where the
    room is unknown (a plan: ``place_on_device``'s ``plan_only``)."""
    if gas <= 1 or grad_tier != "cpu" or stage not in (2, 3):
        return
    if place_on_device(grad_bytes * host, budget=budget, room=room, plan_only=room is None):
        add(ACCUM_ROW, "gpu", grad_bytes * host, kind,
            f"{grad_bytes} * offloaded elements per GPU")
        return
    if stage == 3 and dtype == "fp32":
        return
    (slots, piece), (grp, gname) = staging, group
    slot, of = ((min(math.ceil(grp / world), host), f"min({gname}, Psi) / N") if stage == 3
                else (min(piece, host), f"min({piece}, Psi / N)"))
    add("gradient accumulation staging (pinned fp32)", "cpu", 4 * slots * slot, kind,
        f"4 * {slots} * {of}")


__all__ = ["ACCUM_RESERVE_BYTES", "ACCUM_ROW", "accumulation_rows", "place_on_device"]
