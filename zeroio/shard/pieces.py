"""The NVMe optimizer's cut of a rank's shard: sub-groups, pieces, and finding them by element.

``split`` cuts each ShardGroup's local range into sub-groups of ``sub_group_size`` elements
(DeepSpeed's unit), ``pieces_of`` each sub-group into pieces (the unit of swap I/O: [Note:
pieces stay large] in swap_rule.py). The optimizer (optim/swap.py) and the masters' initial
values (shard/paged.py, written before the optimizer exists) cut alike from the same inputs,
so both name the same pieces. ``PieceIndex`` answers "which pieces hold elements [lo, hi) of
group g" in O(log n) per query, so nothing that touches pieces one by one scans them all
(registration, the step, checkpoints: linear in the number of pieces).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from zeroio.errors import ConfigError


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


def split_numels(numels: Iterable[tuple[int, int]], sub_group_size: int) -> list[SubGroup]:
    """Sub-groups of ``(group_index, padded_numel)`` ranges, ``sub_group_size`` elements each
    (the last of a group shorter)."""
    numels = list(numels)
    size = max(1, sub_group_size)
    count = sum(-(-n // size) for _, n in numels)
    if count > MAX_SUB_GROUPS:
        total = sum(n for _, n in numels)
        raise ConfigError(
            f"zero_optimization.sub_group_size = {sub_group_size} cuts this rank's {total} "
            f"optimizer elements into {count} sub-groups, each its own swap arrays: expected at most "
            f"{MAX_SUB_GROUPS}, i.e. sub_group_size >= {-(-total // MAX_SUB_GROUPS)} here "
            "(DeepSpeed's default is 1e9)", key="zero_optimization.sub_group_size")
    return [SubGroup(group_index=g, start=s, numel=min(size, n - s))
            for g, n in numels for s in range(0, n, size)]


def split(groups, sub_group_size: int) -> list[SubGroup]:
    """``split_numels`` of ShardGroups (their ``group_index`` and ``padded_numel``)."""
    return split_numels(((g.group_index, g.padded_numel) for g in groups), sub_group_size)


def pieces_of(subs: list[SubGroup], piece_elems: int) -> list[SubGroup]:
    """Each sub-group cut into consecutive pieces of at most ``piece_elems`` elements."""
    size = max(1, piece_elems)
    return [SubGroup(group_index=s.group_index, start=o, numel=min(size, s.start + s.numel - o))
            for s in subs for o in range(s.start, s.start + s.numel, size)]


class PieceIndex:
    """Pieces by group, sorted by start, for range queries in O(log n) (module doc)."""

    def __init__(self, pieces: list[SubGroup]):
        self._starts: dict[int, list[int]] = {}
        self._at: dict[int, list[int]] = {}  # piece indices, in the order of _starts
        for i, p in enumerate(pieces):
            self._starts.setdefault(p.group_index, []).append(p.start)
            self._at.setdefault(p.group_index, []).append(i)
        for g, starts in self._starts.items():
            if any(a >= b for a, b in zip(starts, starts[1:], strict=False)):
                order = sorted(range(len(starts)), key=starts.__getitem__)
                self._starts[g] = [starts[k] for k in order]
                self._at[g] = [self._at[g][k] for k in order]
        self.pieces = pieces

    def of_group(self, group_index: int) -> list[int]:
        """Indices of the group's pieces, in element order."""
        return list(self._at.get(group_index, ()))

    def overlapping(self, group_index: int, lo: int, hi: int) -> Iterator[int]:
        """Indices of the group's pieces that hold any element of [lo, hi), in element order."""
        starts = self._starts.get(group_index)
        if not starts or lo >= hi:
            return
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        at = self._at[group_index]
        while k < len(starts) and starts[k] < hi:
            p = self.pieces[at[k]]
            if p.start + p.numel > lo:
                yield at[k]
            k += 1

    def holding(self, group_index: int, element: int) -> int:
        """Index of the piece that holds ``element`` of the group; IndexError if none."""
        for i in self.overlapping(group_index, element, element + 1):
            return i
        raise IndexError(f"no piece holds element {element} of group {group_index}")


__all__ = ["MAX_SUB_GROUPS", "PieceIndex", "SubGroup", "pieces_of", "split", "split_numels"]
