"""How an explicit host budget is shared between stage 3's NVMe parameter store and the NVMe
optimizer, decided without importing torch.

The engine applies these rules (partition/stage3/nvme_store.py picks the resident shards,
tiering/budget.py splits the budget) and ``zeroio.estimate`` plans with them, so the two agree
on every host byte ([Note: budgets in training] in tiering/budget.py):

- resident 16-bit shards (``offload_param.max_in_cpu``) take at most half of the budget, less
  one swap buffer of the largest shard (``resident_cap``); without a budget only
  ``max_in_cpu`` bounds them;
- the parameter store asks for its resident shards and DeepSpeed's swap buffers
  (``buffer_count`` x ``buffer_size`` 16-bit elements, at most the swapped shards' bytes) and
  must have its resident shards and one buffer (``param_floor``);
- it gets what it asks as far as that leaves the optimizer its floor (one swap piece and the
  gradient landing's pieces), never less than its own floor (``param_share``); the optimizer
  gets the rest.
"""

from __future__ import annotations

PAGE = 4096


def host_cost(nbytes: int) -> int:
    """Bytes a host-tier copy holds: whole pages (zeroio.tiering.transfer's rule)."""
    return max(-(-nbytes // PAGE) * PAGE, PAGE)


def resident_cap(cpu_budget: int | None, largest: int) -> int | None:
    """Host bytes the resident shards may take under ``cpu_budget`` (None: no budget, no cap
    beyond ``max_in_cpu``): half of it less one buffer of the ``largest`` shard's bytes. The
    other half is the optimizer's window and resident head: per byte of host memory a resident
    16-bit shard saves 3 bytes of disk I/O a step (read for forward and for backward, written
    once), a cached optimizer piece 2 (read and written once)."""
    return None if cpu_budget is None else max(0, cpu_budget // 2 - largest)


def resident_bytes(group_bytes: list[int], max_in_cpu_bytes: int, cap: int | None) -> int:
    """Bytes of the shards kept resident: greedily in group order while they fit in
    ``max_in_cpu_bytes`` (``max_in_cpu`` elements' bytes) and ``cap`` (host bytes, whole pages
    each); a shard that does not fit is skipped and a later smaller one may still fit."""
    left, room, kept = max_in_cpu_bytes, cap, 0
    for nbytes in group_bytes:
        cost = host_cost(nbytes)
        if nbytes <= left and (room is None or cost <= room):
            kept += nbytes
            left -= nbytes
            if room is not None:
                room -= cost
    return kept


def param_floor(resident: int, largest: int, swapped: int) -> int:
    """The least the parameter store runs in: its resident shards and, when any shard is
    swapped, one buffer of the largest."""
    return resident + (largest if swapped else 0)


def param_ask(resident: int, buffers: int, swapped: int) -> int:
    """What ``offload_param`` asks: the resident shards and the swap buffers (``buffers``
    bytes), at most what the swapped shards take."""
    return resident + min(buffers, swapped)


def param_share(*, left: int, floor: int, ask: int, optimizer_floor: int) -> int:
    """The parameter store's share of ``left`` host bytes (the budget less the state outside
    the stores): what it asks as far as the optimizer keeps its floor, at least its own."""
    return max(floor, min(ask, left - optimizer_floor)) if floor else 0


def group_bytes(shard_elems: int, group_elems: int | None, itemsize: int) -> list[int]:
    """This rank's 16-bit shard as the estimate sees it: groups of ``group_elems`` elements
    (stage 3's flat groups, one layer each; None: one group), ``itemsize`` bytes each."""
    if not group_elems or group_elems >= shard_elems:
        return [shard_elems * itemsize]
    whole, rest = divmod(shard_elems, group_elems)
    return [group_elems * itemsize] * whole + ([rest * itemsize] if rest else [])


def landing_bytes(piece: int, grad_bytes: int, groups: int = 1) -> int:
    """Host bytes of the gradient pieces the landing may hold open at once ([Note: paged
    gradients] in shard/paged_grads.py; optim/swap_plan.py's ``landing_reserve``): one per
    optimizer group (``groups``; the planner assumes one, zeroio's default) and one more, of
    ``piece`` elements of ``grad_bytes`` (0: the gradient does not page)."""
    return (1 + groups) * host_cost(piece * grad_bytes) if grad_bytes else 0


def optimizer_floor(*, shard_elems: int, piece_elems: int, sub_group_size: int,
                    element_bytes: int, grad_bytes: int = 0) -> int:
    """The least host share the NVMe optimizer steps with (optim/swap_plan.py's
    ``min_host_bytes``): one piece of ``element_bytes`` per element (master, moments, paged
    gradient) and, when the gradient pages (``grad_bytes``), the landing's open pieces."""
    piece = max(1, min(shard_elems, piece_elems, sub_group_size))
    return piece * element_bytes + landing_bytes(piece, grad_bytes)


__all__ = ["group_bytes", "host_cost", "landing_bytes", "optimizer_floor", "param_ask",
           "param_floor", "param_share", "resident_bytes", "resident_cap"]
