"""The recorded order of group uses, and what to gather ahead of the next one.

[Note: trace and prefetch]
During the first optimizer step every gather request (forward pre-hook,
pre-backward hook, recomputation under activation checkpointing) appends its
group to the trace. At the step boundary the trace freezes. From then on each
use advances a cursor through the trace (looking ahead for the group if the
model took another path, and switching prefetch off for the rest of the step
if the group is not found); after each use the next groups are gathered
ahead, up to ``stage3_prefetch_bucket_size`` elements, as long as the
gathered total stays within ``stage3_max_live_parameters``. A group about to
be released is kept instead when its next use comes within
``stage3_max_reuse_distance`` gathered elements. Every rank runs the same
model on the same trace, so every rank issues the same collectives in the
same order, which gloo and NCCL both require.
"""

from __future__ import annotations

from zeroio.partition.stage3.settings import Stage3Settings


class Trace:
    def __init__(self, settings: Stage3Settings, numel_of: list[int]):
        self.settings = settings
        self.numel_of = numel_of
        self.order: list[int] = []
        self.frozen = False
        self.cursor = 0
        self.lost = False

    def record(self, gi: int) -> None:
        """Note a use of group ``gi`` and move the cursor to it."""
        if not self.frozen:
            self.order.append(gi)
            return
        if self.lost:
            return
        n = len(self.order)
        for j in range(self.cursor, n):
            if self.order[j] == gi:
                self.cursor = j + 1
                return
        self.lost = True

    def step_boundary(self) -> None:
        self.frozen = True
        self.cursor = 0
        self.lost = False

    def upcoming(self) -> list[int]:
        """Groups to gather ahead of use now, nearest first, within the prefetch bucket."""
        if not self.frozen or self.lost or self.settings.prefetch_bucket_size <= 0:
            return []
        out, total = [], 0
        for gi in self.order[self.cursor:]:
            if gi in out:
                continue
            if total + self.numel_of[gi] > self.settings.prefetch_bucket_size and out:
                break
            out.append(gi)
            total += self.numel_of[gi]
            if total >= self.settings.prefetch_bucket_size:
                break
        return out

    def reused_soon(self, gi: int) -> bool:
        """Whether ``gi`` is used again within ``max_reuse_distance`` gathered elements."""
        if not self.frozen or self.lost:
            return False
        dist = 0
        for other in self.order[self.cursor:]:
            if other == gi:
                return dist <= self.settings.max_reuse_distance
            dist += self.numel_of[other]
            if dist > self.settings.max_reuse_distance:
                return False
        return False
