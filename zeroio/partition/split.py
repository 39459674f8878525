"""The ratio split of ``offload_optimizer.ratio``, one rule for stages 1/2 and 3: which of a
rank's optimizer elements stay on the compute device and which go to the host
([Note: twin placement] in stage3/twin.py, [Note: stage 1/2 twin placement] below).

A rank's local optimizer elements, walked in the stage's order, keep their first
``device_numel(total, ratio)`` on the device; the rest are the host side. A local range is
cut at that point by ``split_range`` (a gradient piece landing, a master being published) and a
segment map by ``cut_segments`` (the two sides' ``ShardGroup.segments``).

[Note: stage 1/2 twin placement]
With ``offload_optimizer.ratio`` r < 1 (offload_optimizer.device cpu) the
rule of stage 3 applies (stage3/twin.py, [Note: twin placement]):
this rank's local shard, walked group by group (each group's buckets' slices
in order), keeps its first ``device_numel(total, r)`` elements on the compute
device (fp32 master and gradient shard there; their moments in the
``TwinAdam``'s device ``ShardedAdam``, stepped by the fused Adam) and the rest
on the host as without a ratio. Each group's device part is a prefix of its
local layout, so the logical ``groups`` keep the layout and segments they have
without a ratio (meta ``master``/``grad``: state goes through the optimizer)
and ``optimizer_split`` holds both sides' physical ShardGroups. Slices are the
same size on every rank, so every rank cuts at the same local offset and
classifies the same buckets as all-device. Consuming a gradient piece splits
it at the cut (the device part never leaves the device); ``run_step``
publishes the device side first (a cast copy on the compute stream, then the
all-gather of buckets with no host element), and the host step's chunks cover
host elements only, so a module whose parameters are all device-side waits
for nothing in an overlapped step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import replace

from zeroio.shard.types import Segment


class Side(enum.Enum):
    """Where one piece of the optimizer state lives and is stepped."""

    HOST = "host"
    """The offload device (pinned CPU memory, or NVMe through the swapper)."""
    DEVICE = "device"
    """The compute device (the GPU; the CPU on a CPU-only machine, same code path)."""


def device_numel(total: int, ratio: float) -> int:
    """Elements of ``total`` kept on the device for ``offload_optimizer.ratio`` = ``ratio``."""
    if ratio >= 1.0:
        return 0
    return min(total, math.floor(total * (1.0 - ratio)))


def split_range(lo: int, numel: int, cut: int) -> list[tuple[int, Side, int, int]]:
    """Elements ``[lo, lo + numel)`` of a local layout whose first ``cut`` elements are the
    device side, as ``(offset in the range, side, start inside that side, length)``: the
    device part first, then the host part (whose starts count from ``cut``)."""
    out = []
    if lo < cut:
        out.append((0, Side.DEVICE, lo, min(numel, cut - lo)))
    if lo + numel > cut:
        a = max(lo, cut)
        out.append((a - lo, Side.HOST, a - cut, lo + numel - a))
    return out


def cut_segments(segments, k: int) -> tuple[list[Segment], list[Segment]]:
    """``segments`` (local offsets) cut at local offset ``k``: those below it, and those above
    it with offsets relative to ``k``; a run straddling ``k`` is cut in two."""
    head, tail = [], []
    for seg in segments:
        a, b = seg.local_offset, seg.local_offset + seg.numel
        if a < k:
            head.append(seg if b <= k else replace(seg, numel=k - a))
        if b > k:
            tail.append(replace(seg, local_offset=a - k) if a >= k else
                        Segment(local_offset=0, global_offset=seg.global_offset + k - a,
                                numel=b - k))
    return head, tail


__all__ = ["Side", "cut_segments", "device_numel", "split_range"]
