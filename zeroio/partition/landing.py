"""Gradient landing, shared by stage 1/2 (stage12.py) and stage 3 (stage3/grads.py): a reduced
device gradient piece -> its place in ``ShardGroup.grad`` (device side or host side of the
ratio split, split.py), and stage 1/2's plan of gradient pieces.

[Note: one landing rule]
Every piece of a reduced gradient lands by the same rule at every stage: the first write of
an accumulation *copies* it (one ``non_blocking`` copy: into pinned host memory that is one
asynchronous D2H DMA), a later write *adds* it in place when the destination is on the same
device, and otherwise needs a staged add (the caller copies it into a pinned fp32 staging
buffer and adds on the host after its one host wait of the backward). What each stage hands
in as the piece differs only where its reduction does: stage 1/2 reduces in the 16-bit
compute dtype (a 16-bit host shard takes the reduced values as they are,
[Note: 16-bit host gradients] in stage12.py); stage 3 reduces in fp32 and casts on the
``d2h`` stream ([Note: 16-bit host gradients at stage 3] in stage3/grads.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroio.partition.flat import Bucket
from zeroio.tiering.stats import TierStats, count_copy


def land(src: torch.Tensor, dst: torch.Tensor, *, first: bool,
         transfers: TierStats | None) -> bool:
    """Land ``src`` in ``dst`` (same length) by [Note: one landing rule]: copy on the first
    write, add on the same device; False, with nothing queued, when the caller must stage the
    add (a later write into another device's memory)."""
    if first:
        count_copy(transfers, src, dst)
        dst.copy_(src, non_blocking=True)
    elif dst.device == src.device:
        dst.add_(src)
    else:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class GradPiece:
    """Part of a bucket's slice consumed at once ([Note: gradient pieces] in stage12.py)."""

    key: int
    """Index in the partitioner's list of every piece."""
    bucket: Bucket
    slice_lo: int
    """Start inside the bucket's slice (this rank's)."""
    numel: int
    params: int
    """Parameters (non-empty) overlapping it: hooks to wait for before consuming it early."""


def plan_pieces(buckets, *, rank: int, world: int, piece_numel: int, early: bool
                ) -> tuple[list[list[GradPiece]], dict[int, list[GradPiece]]]:
    """Each bucket's pieces of at most ``piece_numel`` elements of this rank's slice, and
    (``early``: consumed as their parameters are ready) the pieces each parameter overlaps,
    keyed by ``id(param)``."""
    pieces: list[list[GradPiece]] = []
    of_param: dict[int, list[GradPiece]] = {}
    key = 0
    for b in buckets:
        size, mine = b.slice_numel(world), []
        lo_flat = b.start + rank * size
        for lo in range(0, size, piece_numel):
            k = min(piece_numel, size - lo)
            a, z = lo_flat + lo, lo_flat + lo + k
            over = [s for s in b.slots
                    if s.numel and s.flat_offset < z and a < s.flat_offset + s.numel]
            piece = GradPiece(key=key, bucket=b, slice_lo=lo, numel=k, params=len(over))
            key += 1
            mine.append(piece)
            if early:
                for s in over:
                    of_param.setdefault(id(s.param), []).append(piece)
        pieces.append(mine)
    return pieces, of_param


__all__ = ["GradPiece", "land", "plan_pieces"]
