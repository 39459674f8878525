"""The host step's chunk plan, shared by stage 1/2 (stage12_step.py) and stage 3
(stage3/partitioner.py): how a run of host optimizer elements is cut into the jobs of the
chunked CPU Adam, and which job holds a given element.

[Note: host-step chunks]
A run of ``n`` host elements is cut into ``ceil(n / chunk_numel)`` equal parts (lengths
differ by at most one element), never into full chunks and a small tail: each part is one
CPU Adam call (thread-pool start-up and cache refill per call, step_overlap.py), so a
tail of a few elements would cost a call for nothing. Part ``j`` of ``[lo, hi)`` is
``[lo + n*j // parts, lo + n*(j+1) // parts)``. The math is elementwise, so where the
cuts fall changes no value, only how the work is paced and published.
"""

from __future__ import annotations

import bisect


def chunk_bounds(lo: int, hi: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` as ``(start, end)`` of its equal parts of at most ``chunk_numel`` elements
    ([Note: host-step chunks]); empty when ``hi <= lo``."""
    if chunk_numel < 1:
        raise ValueError(f"host step chunk must be >= 1 element, got {chunk_numel}")
    n = hi - lo
    if n <= 0:
        return []
    parts = -(-n // chunk_numel)
    return [(lo + n * j // parts, lo + n * (j + 1) // parts) for j in range(parts)]


def chunk_holding(bounds: list[tuple[int, int]], element: int) -> int:
    """Index in ``bounds`` (from ``chunk_bounds``) of the part holding ``element``."""
    if not bounds or not bounds[0][0] <= element < bounds[-1][1]:
        raise ValueError(f"element {element} is outside the chunks {bounds[:1]}..{bounds[-1:]}")
    return bisect.bisect_right([a for a, _ in bounds], element) - 1


__all__ = ["chunk_bounds", "chunk_holding"]
