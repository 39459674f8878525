"""The swap plan of the NVMe optimizer: sub-groups, pieces and how their moments use the host budget.

``split`` cuts each ShardGroup's local range into sub-groups of ``sub_group_size``
elements, ``pieces_of`` each sub-group into pieces (the unit of swap I/O), and
``SwapPlan.make`` decides which pieces stay resident and how far to read ahead
([Note: resident head, streamed tail] in optim/swap.py, whose ``SwappedAdam`` runs
the plan). ``min_host_bytes`` is the smallest host share a plan can step with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from zeroio.errors import CapacityError, ConfigError
from zeroio.optim import swap_rule
from zeroio.optim.swap_rule import _PAGE, MAX_PIECE_ELEMS
from zeroio.shard.types import ShardGroup

KINDS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class SubGroup:
    group_index: int
    start: int
    numel: int

    def name(self, kind: str) -> str:
        return f"adam.g{self.group_index}.o{self.start}.{kind}"


MAX_SUB_GROUPS = 1 << 16
"""Sub-groups per rank at most: each is its own pair of swap arrays (and files), so a
``sub_group_size`` tiny beside the shard (1 element: one array per element) would make
initialization run for hours; it is a ConfigError naming the smallest size that fits."""


def split(groups: list[ShardGroup], sub_group_size: int) -> list[SubGroup]:
    size = max(1, sub_group_size)
    count = sum(-(-g.padded_numel // size) for g in groups)
    if count > MAX_SUB_GROUPS:
        numel = sum(g.padded_numel for g in groups)
        raise ConfigError(
            f"zero_optimization.sub_group_size = {sub_group_size} cuts this rank's {numel} optimizer "
            f"elements into {count} sub-groups, each its own swap arrays: expected at most "
            f"{MAX_SUB_GROUPS}, i.e. sub_group_size >= {-(-numel // MAX_SUB_GROUPS)} here "
            "(DeepSpeed's default is 1e9)", key="zero_optimization.sub_group_size")
    return [SubGroup(group_index=g.group_index, start=s, numel=min(size, g.padded_numel - s))
            for g in groups for s in range(0, g.padded_numel, size)]


def pieces_of(subs: list[SubGroup], piece_elems: int) -> list[SubGroup]:
    """Each sub-group cut into consecutive pieces of at most ``piece_elems`` elements."""
    size = max(1, piece_elems)
    return [SubGroup(group_index=s.group_index, start=o, numel=min(size, s.start + s.numel - o))
            for s in subs for o in range(s.start, s.start + s.numel, size)]


def pair_cost(piece: SubGroup, itemsize: int = 4, kinds: int = len(KINDS),
              itemsizes: tuple[int, ...] | None = None) -> int:
    """Host bytes of a piece's two moments (``kinds`` state tensors for another rule) of
    ``itemsize`` bytes per element (4: fp32, 2: bf16) in the store's CPU tier (whole pages
    each); ``itemsizes``: one per tensor instead (paged masters beside the moments)."""
    sizes = itemsizes if itemsizes else (itemsize,) * kinds
    return sum(max(-(-piece.numel * s // _PAGE) * _PAGE, _PAGE) for s in sizes)


@dataclass(frozen=True, kw_only=True)
class SwapPlan:
    """How the moments use the host budget ([Note: resident head, streamed tail])."""

    pieces: tuple[SubGroup, ...]
    resident: int
    """The first ``resident`` pieces stay in host memory; the others stream."""
    read_ahead: int
    """Pieces requested ahead of the one being updated (0: read on demand)."""
    cpu_budget: int
    """Host bytes of the optimizer's store."""
    fits: bool = False
    """Every piece's moments fit in ``cpu_budget`` at once (no swap after the first step)."""
    itemsize: int = 4
    """Bytes per moment element: 4 (fp32) or 2 (bf16 optimizer states)."""
    kinds: int = len(KINDS)
    """State tensors per piece: Adam's two moments, or another rule's (swapped_rule.py)."""
    itemsizes: tuple[int, ...] = ()
    """Bytes per element of each tensor of a piece when they differ (paged masters beside
    the moments); empty: ``kinds`` tensors of ``itemsize``."""

    @property
    def streamed_bytes(self) -> int:
        """Bytes (moments, and paged masters) read from, and written to, the disk per step in
        steady state."""
        per = sum(self.itemsizes) if self.itemsizes else self.itemsize * self.kinds
        return sum(p.numel * per for p in self.pieces[self.resident:])

    @classmethod
    def make(cls, subs: list[SubGroup], *, cpu_budget: int | None, buffer_count: int,
             pipeline_read: bool, piece_elems: int | None = None, read_ahead: int | None = None,
             hold: bool = True, itemsize: int = 4, kinds: int = len(KINDS),
             itemsizes: tuple[int, ...] = ()) -> SwapPlan:
        """``read_ahead``: pieces read ahead (None: ``READ_AHEAD`` with ``pipeline_read``, else
        0). ``hold``: keep the head resident (the trace schedule); False: nothing is held,
        the store's eviction policy decides ([Note: resident head, streamed tail])."""
        ahead = swap_rule.read_ahead(read_ahead, pipeline_read)
        cost = partial(pair_cost, itemsize=itemsize, kinds=max(1, kinds), itemsizes=itemsizes)
        # the window's element size: two tensors' worth of ``itemsize`` unless sizes are given
        elem = sum(itemsizes) / 2 if itemsizes else itemsize
        total = sum(cost(s) for s in subs)
        if piece_elems is None:
            piece_elems = MAX_PIECE_ELEMS
            if cpu_budget is not None and cpu_budget < total:
                # the window (current + read-ahead) takes at most a quarter of the budget
                piece_elems = int(swap_rule.piece_elems_for(cpu_budget, itemsize=elem,
                                                            ahead=ahead))
        pieces = tuple(pieces_of(subs, piece_elems))
        largest = max((cost(p) for p in pieces), default=0)
        if cpu_budget is None:
            # DeepSpeed's meaning: buffer_count host buffers of the largest sub-group's moment
            sub_bytes = max((cost(s) // max(1, len(itemsizes) or kinds) for s in subs), default=0)
            cpu_budget = min(total, max(4, buffer_count) * sub_bytes)
            cpu_budget = max(cpu_budget, min(total, (1 + ahead) * largest))
        if cpu_budget >= total:
            return cls(pieces=pieces, resident=len(pieces) if hold else 0, read_ahead=ahead,
                       cpu_budget=cpu_budget, fits=True, itemsize=itemsize, kinds=kinds,
                       itemsizes=itemsizes)
        while ahead and (1 + ahead) * largest > cpu_budget:
            ahead -= 1
        window = (1 + ahead) * largest
        if window > cpu_budget:
            raise CapacityError(
                f"offload_optimizer nvme: the optimizer's host share of {cpu_budget} bytes cannot "
                f"hold one piece's two moments ({largest} bytes needed); raise "
                f"zero_optimization.tiering.cpu_budget_bytes or lower sub_group_size")
        if not hold:
            return cls(pieces=pieces, resident=0, read_ahead=ahead, cpu_budget=cpu_budget,
                       itemsize=itemsize, kinds=kinds, itemsizes=itemsizes)
        room, resident = cpu_budget - window, 0
        for p in pieces:
            if cost(p) > room:
                break
            room -= cost(p)
            resident += 1
        return cls(pieces=pieces, resident=resident, read_ahead=ahead, cpu_budget=cpu_budget,
                   itemsize=itemsize, kinds=kinds, itemsizes=itemsizes)


def min_host_bytes(groups: list[ShardGroup], sub_group_size: int, itemsize: int = 4,
                   itemsizes: tuple[int, ...] = ()) -> int:
    """The smallest host share the optimizer can step with: one smallest piece's two moments
    (or all moments, when smaller), of ``itemsize`` bytes per element (``itemsizes``: one
    per tensor, paged masters beside the moments). What ``SwapPlan.make`` needs at the
    least."""
    total = sum(pair_cost(s, itemsize, itemsizes=itemsizes)
                for s in split(groups, sub_group_size))
    return min(total, (len(itemsizes) or len(KINDS)) * _PAGE)
