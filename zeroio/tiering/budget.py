"""How an explicit tier budget is shared by all the state the engine keeps in that tier.

[Note: budgets in training]
``zero_optimization.tiering.cpu_budget_bytes`` bounds everything
``engine.stats()["tiers"]["cpu"]`` counts, not one store's buffers. The
engine splits it once, at initialize, after the partitioner has allocated its
host state and before the NVMe optimizer plans its swap:

1. state outside any store (``held``: host fp32 masters (none when they page with the
   moments), gradient shards, flat 16-bit buffers, staging, in-memory moments) comes
   first: it cannot move;
2. stage 3's NVMe parameter store takes what ``offload_param`` asks
   (``buffer_count * buffer_size`` 16-bit elements of swap buffers, at most
   the NVMe shards' bytes, plus the ``max_in_cpu`` shards it keeps resident:
   DeepSpeed's meaning), as far as that leaves the optimizer its smallest
   window, and never less than its own floor (resident shards + one buffer of
   the largest NVMe shard);
3. the NVMe optimizer's store (``SwappedAdam``) gets the rest and plans its
   resident head and streamed tail in it.

A budget below ``held`` + both floors is a ``CapacityError`` naming the key,
the bytes needed (itemised) and the bytes given. ``nvme_budget_bytes`` is
split the same way: the parameter store keeps exactly its shards' bytes, the
optimizer gets the rest. ``engine.stats()`` reports the user's budget, not a
store's share. Without an explicit budget nothing is split (each store derives
its own, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroio.config.host_split import param_share
from zeroio.errors import CapacityError

CPU_KEY = "zero_optimization.tiering.cpu_budget_bytes"


@dataclass(frozen=True, kw_only=True)
class HostSplit:
    """Shares of an explicit CPU budget ([Note: budgets in training])."""

    budget: int
    held: int
    params: int
    """The stage-3 NVMe parameter store's share (0 without one)."""
    optimizer: int
    """What is left for the NVMe optimizer's store."""


def split_host_budget(budget: int, *, held: int, param_floor: int = 0, param_ask: int = 0,
                      optimizer_floor: int = 0) -> HostSplit:
    """Split ``budget`` host bytes: ``held`` first, then the parameter store (``param_ask``,
    at least ``param_floor``), then the optimizer (the rest, at least ``optimizer_floor``)."""
    need = held + param_floor + optimizer_floor
    if budget < need:
        parts = [f"state outside the stores (masters, gradients, buffers) {held}"]
        if param_floor:
            parts.append(f"parameter swap (resident shards + one shard buffer) {param_floor}")
        if optimizer_floor:
            parts.append(f"optimizer swap window (one piece's two moments) {optimizer_floor}")
        raise CapacityError(
            f"{CPU_KEY} = {budget} bytes is smaller than what must stay in host memory: "
            f"{need} bytes needed ({' + '.join(parts)}), {budget} given; raise "
            f"{CPU_KEY} to at least {need}"
            + (" or lower offload_param.max_in_cpu" if param_floor else ""))
    left = budget - held
    params = param_share(left=left, floor=param_floor, ask=param_ask,
                         optimizer_floor=optimizer_floor)
    return HostSplit(budget=budget, held=held, params=params, optimizer=left - params)
