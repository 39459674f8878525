"""Per-parameter norms of flat shards: what Lamb's trust ratio needs when parameters are cut
across ranks.

[Note: sharded trust ratio]
Lamb scales each parameter's update by ``||w|| / ||u||`` of the whole parameter tensor, but a
rank holds only its ShardGroups' runs of the global flat order (stage 2 and 3 cut parameters
at rank boundaries). ``ParamRuns`` maps a group's local elements to the parameters they belong
to (from the group's ``segments`` and the model's ``ParamIndex``); each rank sums the squares
of its runs per parameter, one all-reduce over the partitioner's process group adds the ranks'
sums, and every rank then holds the norms of the unsharded parameters. Padding (local elements
in no segment) belongs to no parameter and is neither summed nor updated. Stage 0 keeps
everything on every rank: nothing is reduced.
"""

from __future__ import annotations

import bisect

import torch

from zeroio.shard.types import ParamIndex, ShardGroup
from zeroio.tiering.copies import Copies


class ParamRuns:
    """Every run of a group's local tensor that lies in one parameter: (parameter number,
    local start, length), parameters numbered in the index's order."""

    def __init__(self, group: ShardGroup, index: ParamIndex):
        starts = [e.offset for e in index.entries]
        self.runs: list[tuple[int, int, int]] = []
        for s in group.segments:
            lo, end = s.global_offset, s.global_offset + s.numel
            k = bisect.bisect_right(starts, lo) - 1
            while lo < end:
                e = index.entries[k]
                hi = min(end, e.offset + e.numel)
                if hi > lo:
                    self.runs.append((k, s.local_offset + lo - s.global_offset, hi - lo))
                lo = max(lo, hi)
                k += 1

    def add_squares(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out[k] += sum(t[run] ** 2)`` over the runs of parameter k (float64 sums; ``out``
        on ``t``'s device, so a GPU step does not wait on each sum)."""
        add_run_squares(self.runs, t, out)

    def within(self, lo: int, n: int) -> list[tuple[int, int, int]]:
        """The runs clipped to local elements [lo, lo + n): (parameter number, start relative
        to ``lo``, length) each (a swap piece's share of the group's runs)."""
        out = []
        for k, a, m in self.runs:
            b, e = max(a, lo), min(a + m, lo + n)
            if b < e:
                out.append((k, b - lo, e - b))
        return out


def add_run_squares(runs, t: torch.Tensor, out: torch.Tensor) -> None:
    """``out[k] += sum(t[run] ** 2)`` over ``runs`` ((k, start in ``t``, length) each)."""
    for k, lo, n in runs:
        piece = t.narrow(0, lo, n)
        out[k] += torch.dot(piece, piece).double()


def reduce_sums(sums: torch.Tensor, *, all_reduce, comm_device: torch.device,
                copies: Copies) -> torch.Tensor:
    """The ranks' per-parameter sums added up by ``all_reduce`` (an in-place sum over the
    partitioner's process group that the engine hands in: partition/collectives.py is the one
    caller of torch.distributed; None: every rank holds every parameter, stage 0);
    ``comm_device``: where the collective needs the tensor; ``copies``: the handle the sums
    cross host <-> device through. Returns a CPU tensor."""
    if all_reduce is None:
        return copies.host(sums)
    t = copies.to(sums, comm_device)
    all_reduce(t)
    return copies.host(t)


__all__ = ["ParamRuns", "add_run_squares", "reduce_sums"]
