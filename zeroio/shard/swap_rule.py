"""The NVMe optimizer's pieces and its use of its host share, decided without importing torch.

``zeroio.estimate`` plans with these figures; ``SwapPlan.make`` (optim/swap_plan.py) and
``SwappedAdam`` apply the same rules in training ([Note: resident head, streamed tail] in
optim/swap.py): the window (the piece being updated and ``read_ahead`` pieces requested ahead) comes
out of the share first, the first whole pieces that fit the rest stay resident, and when the
NVMe budget cannot hold every moment the resident head is homed in host memory, so the disk
holds only the streamed tail. Pieces are counted without their sub-group remainders: the
figures are within one piece of the runtime's.

[Note: pieces stay large]
A piece is the unit of swap I/O: one file per tensor kind, read and written whole. Its size
is chosen once, from the host budget, and never falls below ``MIN_PIECE_ELEMS`` (8 MiB of
fp32 per tensor) whatever the budget: a budget too small for the window of pieces that size
is a ``CapacityError`` at initialize, not millions of page-sized pieces (at 2.69B parameters,
one page per piece was 2 million files per kind and an initialize that never ended). Only a
sub-group (``sub_group_size``) or a shard smaller than the floor makes a smaller piece. The
number of pieces is then the state over at least 8 MiB: linear in the model, a few thousand
at most per rank for any model one host trains.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PIECE_ELEMS = 1 << 24
"""Largest swap piece: 64 MiB per moment. Small enough that reads, updates and writes of
neighbouring pieces overlap within a step (a 1e9-element sub-group would leave one 4 GB
transfer per moment with nothing to overlap it), large enough for full-speed disk I/O."""
MIN_PIECE_ELEMS = 1 << 21
"""Smallest swap piece a budget can ask for: 8 MiB per fp32 tensor ([Note: pieces stay
large]). The I/O engine submits ``queue_depth`` x ``block_size`` (8 MiB by default) at once:
a smaller piece would leave the queue part empty."""
READ_AHEAD = 3
"""Streamed pieces requested ahead of the one being updated (with ``pipeline_read``): the
window holds them and the current one; the last of them starts reading as soon as the
write-back of the previous piece frees its space."""
_PAGE = 4096


@dataclass(frozen=True, kw_only=True)
class MomentSplit:
    """Where one rank's host-side Adam moments live (bytes)."""

    window: int
    """Pinned host bytes of the swap window (current piece + read-ahead)."""
    resident: int
    """Moment bytes the host share keeps resident."""
    disk: int
    """Moment bytes homed on NVMe: all of them, or the streamed tail when the NVMe budget
    cannot hold them all."""


def read_ahead(prefetch_depth: int | None, pipeline_read: bool) -> int:
    return prefetch_depth if prefetch_depth is not None else (READ_AHEAD if pipeline_read else 0)


def piece_elems_for(share: int | None, *, itemsize: float, ahead: int) -> int:
    """Elements per swap piece for a host share of ``share`` bytes (None: no budget, the
    largest): the window (current piece + ``ahead``) takes at most a quarter of it, within
    [MIN_PIECE_ELEMS, MAX_PIECE_ELEMS] ([Note: pieces stay large]). ``itemsize``: bytes per
    element of each of a piece's two tensors (paged masters: half of the three's sum)."""
    if share is None:
        return MAX_PIECE_ELEMS
    return int(min(MAX_PIECE_ELEMS,
                   max(MIN_PIECE_ELEMS, share // (4 * itemsize * 2 * (1 + ahead)))))


def moment_split(numel: int, *, share: int, itemsize: float, ahead: int,
                 nvme_budget: int | None, sub_group_size: int | None = None) -> MomentSplit:
    """The split of ``numel`` elements' two moments (``itemsize`` bytes each) for a host share
    of ``share`` bytes (what the optimizer's store gets of ``tiering.cpu_budget_bytes``) and
    an NVMe budget of ``nvme_budget`` bytes (None: room for all); pieces at most
    ``sub_group_size`` elements (None: no bound)."""
    total = int(2 * itemsize * numel)
    if share >= total:
        return MomentSplit(window=0, resident=total, disk=total)
    piece = min(numel, piece_elems_for(share, itemsize=itemsize, ahead=ahead),
                sub_group_size or numel)
    pair = int(2 * itemsize * piece)
    while ahead and (1 + ahead) * pair > share:
        ahead -= 1
    window = min(share, (1 + ahead) * pair)
    resident = min(total, max(0, share - window) // pair * pair)
    disk = total if nvme_budget is None or total <= nvme_budget else total - resident
    return MomentSplit(window=window, resident=resident, disk=disk)
