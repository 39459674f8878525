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

[Note: bounded staging]
A staged add needs pinned fp32 memory for the piece while it crosses PCIe, but only until the
host has added it. ``StagedAdds`` keeps ``STAGING_SLOTS`` such buffers, each of the largest
group's slice, instead of one per group: with gradient accumulation a per-group staging is a
second fp32 copy of the whole host gradient (4 bytes per offloaded element: 28 GB of pinned
memory for a 15B model's host side). A worker thread waits for each piece's copy (its CUDA
event) and adds it on the host while the backward goes on, and gives the slot back; the
backward waits only when every slot is still in flight, and ``drain`` (the caller's one host
wait of the backward) waits for the rest. The adds run in the order staged, one at a time, as
before in ``settle``, so the sums are bit-equal to the unbounded staging's.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zeroio.io.hostmem import host_empty
from zeroio.partition.flat import Bucket
from zeroio.shard.host_rule import STAGING_SLOTS
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats


def land(src: torch.Tensor, dst: torch.Tensor, *, first: bool,
         transfers: TierStats | None) -> bool:
    """Land ``src`` in ``dst`` (same length) by [Note: one landing rule]: copy on the first
    write, add on the same device; False, with nothing queued, when the caller must stage the
    add (a later write into another device's memory)."""
    if first:
        Copies(transfers).into(dst, src, non_blocking=True)
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



class StagedAdds:
    """Later writes of a gradient into host memory, added on the host through a bounded pool of
    pinned fp32 buffers of ``numel`` elements ([Note: bounded staging])."""

    def __init__(self, numel: int, *, pin: bool, transfers: TierStats | None = None,
                 slots: int = STAGING_SLOTS):
        if slots < 1 or numel < 1:
            raise ValueError(f"StagedAdds needs slots >= 1 and numel >= 1, got {slots}, {numel}")
        self.numel, self.slots, self.pin = numel, slots, pin
        self.transfers = transfers
        self._buffers: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._inflight: collections.deque[Future] = collections.deque()
        self._worker: ThreadPoolExecutor | None = None

    def reserve(self) -> None:
        """Allocate every slot now (before the engine splits its host budget)."""
        while len(self._buffers) < self.slots:
            self._new()

    def _new(self) -> None:
        buf = host_empty(self.numel, torch.float32, pin=self.pin)
        self._buffers.append(buf)
        self._free.append(buf)

    def _take(self) -> torch.Tensor:
        if not self._free and len(self._buffers) < self.slots:
            self._new()
        while not self._free:
            self._wait_oldest()
        return self._free.pop()

    def _wait_oldest(self) -> None:
        fut = self._inflight.popleft()
        with StallTimer(self.transfers):
            self._free.append(fut.result())

    def stage(self, parts: list[tuple[torch.Tensor, torch.Tensor]],
              stream: torch.cuda.Stream | None) -> None:
        """Copy each ``(src, dst)``'s ``src`` (device) into one slot on the current stream and
        have the worker add it to ``dst`` (host) once the copy has landed; ``stream``: the
        current CUDA stream, whose event the worker waits for (None: the copies are done)."""
        total = sum(src.numel() for src, _ in parts)
        if total > self.numel:
            raise ValueError(f"staged pieces of {total} elements exceed the slot's {self.numel}")
        buf = self._take()
        adds, off = [], 0
        for src, dst in parts:
            view = buf.narrow(0, off, src.numel())
            Copies(self.transfers).into(view, src, non_blocking=True)
            adds.append((view, dst))
            off += src.numel()
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="zeroio-staged-add")
        self._inflight.append(self._worker.submit(_add, event, adds, buf))

    def drain(self) -> None:
        """Wait until every staged add has been applied."""
        while self._inflight:
            self._wait_oldest()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def close(self) -> None:
        """Apply what is staged and stop the worker (the buffers stay until dropped)."""
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _add(event: torch.cuda.Event | None, adds, buf: torch.Tensor) -> torch.Tensor:
    if event is not None:
        event.synchronize()
    for view, dst in adds:
        dst.add_(view)
    return buf


__all__ = ["GradPiece", "StagedAdds", "land", "plan_pieces"]
