"""The swap plan of the NVMe optimizer: how its pieces use the host budget.

``split`` cuts each ShardGroup's local range into sub-groups of ``sub_group_size``
elements, ``pieces_of`` each sub-group into pieces (the unit of swap I/O; both in
shard/pieces.py, re-exported here), and ``SwapPlan.make`` decides which pieces stay
resident and how far to read ahead ([Note: resident head, streamed tail] in optim/swap.py,
whose ``SwappedAdam`` runs the plan). ``min_host_bytes`` is the smallest host share a plan
can step with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from zeroio.errors import CapacityError
from zeroio.shard import swap_rule
from zeroio.shard.pieces import MAX_SUB_GROUPS, SubGroup, pieces_of, split  # noqa: F401
from zeroio.shard.swap_rule import _PAGE, MIN_PIECE_ELEMS
from zeroio.shard.types import ShardGroup

KINDS = ("exp_avg", "exp_avg_sq")


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
    landing_bytes: int = 0
    """Host bytes kept for the gradient landing's open pieces ([Note: paged gradients] in
    shard/paged_grads.py): outside the window and the resident head."""

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
             itemsizes: tuple[int, ...] = (), landing: int = 0) -> SwapPlan:
        """``read_ahead``: pieces read ahead (None: ``READ_AHEAD`` with ``pipeline_read``, else
        0). ``hold``: keep the head resident (the trace schedule); False: nothing is held,
        the store's eviction policy decides ([Note: resident head, streamed tail]).
        ``landing``: bytes per element of a paged gradient (one of ``itemsizes``; 0: none),
        whose landing keeps ``landing_pieces`` of them open beside the window."""
        ahead = swap_rule.read_ahead(read_ahead, pipeline_read)
        cost = partial(pair_cost, itemsize=itemsize, kinds=max(1, kinds), itemsizes=itemsizes)
        # the window's element size: two tensors' worth of ``itemsize`` unless sizes are given
        elem = sum(itemsizes) / 2 if itemsizes else itemsize
        total = sum(cost(s) for s in subs)
        if piece_elems is None:
            # the window (current + read-ahead) takes at most a quarter of the budget, and a
            # piece stays large ([Note: pieces stay large] in shard/swap_rule.py)
            piece_elems = swap_rule.piece_elems_for(
                cpu_budget if cpu_budget is not None and cpu_budget < total else None,
                itemsize=elem, ahead=ahead)
        pieces = tuple(pieces_of(subs, piece_elems))
        largest = max((cost(p) for p in pieces), default=0)
        reserve = landing_reserve(subs, pieces, landing)
        if cpu_budget is None:
            # DeepSpeed's meaning: buffer_count host buffers of the largest sub-group's moment
            sub_bytes = max((cost(s) // max(1, len(itemsizes) or kinds) for s in subs), default=0)
            cpu_budget = min(total, max(4, buffer_count) * sub_bytes)
            cpu_budget = max(cpu_budget, min(total, (1 + ahead) * largest + reserve))
        if cpu_budget >= total:
            return cls(pieces=pieces, resident=len(pieces) if hold else 0, read_ahead=ahead,
                       cpu_budget=cpu_budget, fits=True, itemsize=itemsize, kinds=kinds,
                       itemsizes=itemsizes)
        while ahead and (1 + ahead) * largest + reserve > cpu_budget:
            ahead -= 1
        window = (1 + ahead) * largest
        if window + reserve > cpu_budget:
            raise CapacityError(
                f"offload_optimizer nvme: the optimizer's host share of {cpu_budget} bytes cannot "
                f"hold one swap piece ({largest} bytes needed: {max(p.numel for p in pieces)} "
                f"elements of {len(itemsizes) or kinds} tensors, plus {reserve} for the "
                "gradient landing; a piece stays large, [Note: pieces stay large] in "
                "zeroio/shard/swap_rule.py); raise zero_optimization.tiering.cpu_budget_bytes")
        if not hold:
            return cls(pieces=pieces, resident=0, read_ahead=ahead, cpu_budget=cpu_budget,
                       itemsize=itemsize, kinds=kinds, itemsizes=itemsizes,
                       landing_bytes=reserve)
        room, resident = cpu_budget - window - reserve, 0
        for p in pieces:
            if cost(p) > room:
                break
            room -= cost(p)
            resident += 1
        return cls(pieces=pieces, resident=resident, read_ahead=ahead, cpu_budget=cpu_budget,
                   itemsize=itemsize, kinds=kinds, itemsizes=itemsizes, landing_bytes=reserve)


def landing_reserve(subs: list[SubGroup], pieces, landing: int) -> int:
    """Host bytes of the gradient pieces the landing may hold open at once (``landing``: a
    paged gradient's bytes per element; 0: none): one per optimizer group (each fills its
    pieces from the last down, as the backward reaches them) and one more (a group whose
    landing spans a piece boundary)."""
    if not landing:
        return 0
    open_pieces = 1 + len({s.group_index for s in subs})
    return open_pieces * max((pair_cost(p, landing, kinds=1) for p in pieces), default=0)


def min_host_bytes(groups: list[ShardGroup], sub_group_size: int, itemsize: int = 4,
                   itemsizes: tuple[int, ...] = (), piece_elems: int | None = None,
                   landing: int = 0) -> int:
    """The smallest host share the optimizer can step with: one piece of its state at the
    smallest piece size a budget may ask for (``piece_elems``, when the cut is decided already:
    paged masters; else ``MIN_PIECE_ELEMS``), or all of it when smaller, of ``itemsize`` bytes
    per element (``itemsizes``: one per tensor, paged masters beside the moments), and the
    gradient landing's open pieces (``landing``: a paged gradient's bytes per element). What
    ``SwapPlan.make`` needs at the least."""
    subs = split(groups, sub_group_size)
    total = sum(pair_cost(s, itemsize, itemsizes=itemsizes) for s in subs)
    pieces = pieces_of(subs, piece_elems or MIN_PIECE_ELEMS)
    largest = max((pair_cost(p, itemsize, itemsizes=itemsizes) for p in pieces), default=0)
    return min(total, largest + landing_reserve(subs, pieces, landing))
