"""Where a registered tensor's home goes, and what each tier's budget must keep room for.

[Note: placement] ``register(home=T)`` places the home in T if T's budget has
room, else in the next slower tier (GPU -> CPU -> NVMe), so free GPU memory
holds state that does not fit in CPU and the whole machine is usable. The CPU
tier always keeps room for the largest NVMe-homed tensor, since every disk
transfer passes through pinned host memory; a registration that would break
that, or that no tier can hold, is a CapacityError naming budgets and bytes.
The same floor bounds ``shrink_budget``: a tier's share must hold its homes and,
for CPU, one NVMe transfer.

Bookkeeping only: these functions read the tiers' ``Space`` records (called with
the store's lock held) and move no bytes; making room is the mover's. The largest NVMe home
is kept by ``NvmeHomes`` as homes come and go, never found by scanning the entries: a
registration costs the same whether it is the first or the millionth.
"""

from __future__ import annotations

from collections import Counter

from zeroio.config.policy import TieringPolicy
from zeroio.errors import CapacityError
from zeroio.tiering.config import Budgets
from zeroio.tiering.mover import Mover
from zeroio.tiering.state import Entry, Space
from zeroio.tiering.tier import Tier

ORDER = (Tier.GPU, Tier.CPU, Tier.NVME)
"""The tiers, fastest first: a home that does not fit goes to the next slower one."""


class NvmeHomes:
    """The CPU-tier cost of every NVMe-homed tensor, counted by size: ``largest`` is what
    the CPU tier keeps room for ([Note: placement]) in O(1), updated as homes are added and
    removed (the distinct sizes are few: the pieces of a cut are alike)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self.largest = 0

    def add(self, cost: int) -> None:
        self._counts[cost] += 1
        self.largest = max(self.largest, cost)

    def remove(self, cost: int) -> None:
        self._counts[cost] -= 1
        if self._counts[cost] <= 0:
            del self._counts[cost]
            if cost == self.largest:
                self.largest = max(self._counts, default=0)


def place(spaces: dict[Tier, Space], homes: NvmeHomes, name: str, nbytes: int,
          want: Tier, *, has_nvme: bool) -> Tier | None:
    """The first tier from ``want`` down whose budget holds the home ([Note: placement]);
    None when none does."""
    cpu = spaces[Tier.CPU]
    largest_nvme = homes.largest
    for tier in ORDER[ORDER.index(want):]:
        space = spaces[tier]
        cost = space.cost(nbytes)
        if space.budget == 0 or space.home_used + cost > space.budget:
            continue
        if tier is Tier.NVME and not has_nvme:
            continue
        cpu_homes = cpu.home_used + (cost if tier is Tier.CPU else 0)
        staging = max(largest_nvme, cpu.cost(nbytes) if tier is Tier.NVME else 0)
        if staging and cpu_homes + staging > cpu.budget:
            continue
        return tier
    return None


def no_tier_error(spaces: dict[Tier, Space], entries: dict[str, Entry], name: str, nbytes: int,
                  want: Tier, *, has_nvme: bool, budgets: Budgets,
                  cfg: TieringPolicy) -> CapacityError:
    """The error of a registration no tier can hold: budgets, homes, bytes and the fix."""
    cpu = spaces[Tier.CPU]
    total = sum(e.nbytes for e in entries.values())
    lines = ", ".join(
        f"{t.value} {spaces[t].budget} (homes {spaces[t].home_used})" for t in ORDER)
    hint = ""
    if cpu.cost(nbytes) > cpu.budget and want is not Tier.GPU:
        hint = (f"; the CPU budget ({cpu.budget}) must hold the largest tensor ({cpu.cost(nbytes)} "
                f"bytes as pages), since NVMe data passes through pinned host memory")
    if not has_nvme:
        fix = "set an nvme_path"
    else:
        fix = "give the NVMe tier more room"
        if budgets.nvme_free is not None:  # derived: free space minus the reserve
            hint += (f"; the NVMe budget is the {budgets.nvme_free:,} bytes free under "
                     f"{cfg.nvme_path} minus zero_optimization.tiering.nvme_reserve_bytes "
                     f"= {cfg.nvme_reserve_bytes:,} (kept free): free space there, point "
                     "nvme_path at a file system with room, or lower nvme_reserve_bytes")
    return CapacityError(
        f"register({name!r}): {nbytes} bytes fit in no tier from {want.value} down. Budgets "
        f"in bytes: {lines}; registered so far {total} + {nbytes} needed{hint}. Raise "
        f"zero_optimization.tiering.{{gpu,cpu,nvme}}_budget_bytes or {fix}"
    )


def place_with_room(spaces: dict[Tier, Space], entries: dict[str, Entry], homes: NvmeHomes,
                    mover: Mover, name: str, nbytes: int, want: Tier, *, has_nvme: bool,
                    budgets: Budgets, cfg: TieringPolicy) -> Tier:
    """``place``, then make room there; a tier whose room is held by acquired copies that
    cannot be released in time passes the home on to the next slower tier."""
    tier = place(spaces, homes, name, nbytes, want, has_nvme=has_nvme)
    if tier is None:
        raise no_tier_error(spaces, entries, name, nbytes, want, has_nvme=has_nvme,
                            budgets=budgets, cfg=cfg)
    while tier is not Tier.NVME:
        space = spaces[tier]
        try:
            mover.make_room(space, space.cost(nbytes), name, prefetch=False)
            return tier
        except CapacityError as exc:
            slower = ORDER[ORDER.index(tier) + 1:]
            tier = place(spaces, homes, name, nbytes, slower[0], has_nvme=has_nvme) \
                if slower else None
            if tier is None:
                raise CapacityError(f"register({name!r}): {nbytes} bytes: {exc}") from exc
    return tier


def check_shrink(spaces: dict[Tier, Space], homes: NvmeHomes, tier: Tier, nbytes: int) -> None:
    """``CapacityError`` when ``nbytes`` cannot hold ``tier``'s homes and, for CPU, room for
    the largest NVMe-homed tensor ([Note: placement])."""
    space = spaces[tier]
    staging = homes.largest if tier is Tier.CPU else 0
    need = space.home_used + staging
    if nbytes < need:
        raise CapacityError(
            f"tiered store: the {tier.value} tier's share of {nbytes} bytes cannot hold "
            f"its homes ({space.home_used} bytes) and one NVMe transfer ({staging} "
            f"bytes): {need} bytes needed; raise "
            f"zero_optimization.tiering.{tier.value}_budget_bytes")
