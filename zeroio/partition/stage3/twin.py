"""Which of this rank's optimizer elements stay on the compute device (offload_optimizer.ratio).

[Note: twin placement]
DeepSpeed's ``offload_optimizer.ratio`` r is the fraction of the optimizer
state that is offloaded. The partitioner walks this rank's shard pieces in its
group order (the flat groups of layout.py, in module order, which is about the
order the forward uses them; each group's pieces by optimizer group) and puts
the first ``device_numel(total, r) = floor((1 - r) * total)`` elements on the
device side, cutting the one piece that straddles the boundary, and the rest
on the host side. Each side has its own ``ShardGroup`` per optimizer param
group (an empty one where the side holds none of it): the device side's fp32
master, gradient shard (and, in the optimizer, moments) live on the compute
device and are stepped there by the fused Adam; the host side is what the
partitioner had before (pinned host memory, CPU Adam, or the NVMe swapper).
The earliest groups go to the device because the device part is stepped and
published first: with the overlapped host step, the next forward starts on
them while the CPU still works on the later ones.

The engine and the checkpoint layer see one *logical* ``ShardGroup`` per
optimizer group whose local layout is ``[device part | host part]``: its
segments map both parts to the global flat order. Its ``master`` and
``grad`` are meta tensors of the logical length (no memory; any access to
their data fails loudly); their values are read through the optimizer
(``zeroio.optim.twin.TwinAdam``: ``local_tensor`` / ``read_local``).
Every element is on exactly one side, so the gradient norm over both sides'
gradient shards counts it once.

[Note: asynchronous device-side publish]
With offload_param cpu the 16-bit shards live in pinned host memory, so
publishing the device side means copying ~2 bytes per device element to the
host (15 GB at 13B and ratio 0.42: ~0.3 s at 55 GB/s). ``DevicePublish``
does it on the ``d2h`` stream ([Note: stage-3 streams]) without a host wait:
the stream waits for the device step on the compute stream, casts each piece
into one reused bf16 staging buffer of ``PUBLISH_CHUNK_NUMEL`` elements and
copies it into the host shard (cast and copy are ordered on that one stream,
so the buffer is reused without events), and records one event per group.
Who waits, and how:
- the next fetch of a group (its H2D copy, on ``h2d``) waits on that group's
  event on the device (``before_fetch``), so a gather never reads an old shard;
- writers of the device masters (the next device step after
  ``finalize_gradients``, a checkpoint load) are ordered after the last event
  on their stream (``order_writers``): the copies read the masters;
- host code that reads or writes the host shards itself (``publish_params``,
  ``write_back``, ``close``) waits on the host (``settle``).
The host step's jobs write the host side's pieces of the same shards while
these copies run: the two sides' ranges are disjoint. Without CUDA (or with
NVMe shards) the publish is the synchronous ``update_shard_pieces`` it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from zeroio.partition.base import ShardGroup
from zeroio.partition.split import Side, cut_segments, device_numel  # noqa: F401 (re-exported)
from zeroio.partition.stage3.layout import ShardPiece
from zeroio.partition.stage3.streams import on, record, wait_event, wait_stream
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats

PUBLISH_CHUNK_NUMEL = 1 << 26
"""Elements of the device-side publish's bf16 staging buffer (128 MiB); zeroio.estimate
counts it (PUBLISH_CHUNK_NUMEL there, kept equal by tests/test_optim_ratio.py)."""


def split_piece(piece: ShardPiece, k: int) -> tuple[ShardPiece, ShardPiece]:
    """``piece`` cut after its first ``k`` elements (0 < k < its length), segments and names
    cut with it; offsets of the second part are relative to its own ``lo``."""
    n = piece.hi - piece.lo
    if not 0 < k < n:
        raise ValueError(f"split_piece: cut {k} outside (0, {n})")
    head_segs, tail_segs = cut_segments(piece.segments, k)
    pairs = list(zip(piece.segments, piece.names, strict=True))
    head = ShardPiece(opt_group=piece.opt_group, lo=piece.lo, hi=piece.lo + k,
                      segments=tuple(head_segs),
                      names=tuple(nm for seg, nm in pairs if seg.local_offset < k))
    tail = ShardPiece(opt_group=piece.opt_group, lo=piece.lo + k, hi=piece.hi,
                      segments=tuple(tail_segs),
                      names=tuple(nm for seg, nm in pairs if seg.local_offset + seg.numel > k))
    return head, tail


def place(pieces: list[tuple[int, ShardPiece]], on_device: int
          ) -> list[tuple[int, ShardPiece, Side]]:
    """``(group, piece)`` in order -> ``(group, piece, side)``: the first ``on_device``
    elements on the device side ([Note: twin placement])."""
    out, taken = [], 0
    for gi, pc in pieces:
        n = pc.hi - pc.lo
        room = on_device - taken
        if room >= n:
            out.append((gi, pc, Side.DEVICE))
            taken += n
        elif room > 0:
            head, tail = split_piece(pc, room)
            out += [(gi, head, Side.DEVICE), (gi, tail, Side.HOST)]
            taken += room
        else:
            out.append((gi, pc, Side.HOST))
    return out


@dataclass(frozen=True, kw_only=True)
class OptimizerSplit:
    """The physical ShardGroups of both sides, one per optimizer param group each (position ==
    ``group_index``); ``build_optimizer`` steps ``device`` on the compute device and ``host``
    where offload_optimizer.device says."""

    device: list[ShardGroup]
    host: list[ShardGroup]

    def numel(self, side: Side) -> int:
        groups = self.device if side is Side.DEVICE else self.host
        return sum(g.numel for g in groups)


def logical_group(dev: ShardGroup, host: ShardGroup) -> ShardGroup:
    """One optimizer group's ShardGroup as the engine and checkpoints see it: local layout
    ``[device part | host part]``, meta ``master``/``grad`` (see the note)."""
    d = dev.padded_numel
    segs = dev.segments + tuple(replace(s, local_offset=s.local_offset + d)
                                for s in host.segments)
    n = d + host.padded_numel
    return ShardGroup(group_index=dev.group_index,
                      master=torch.empty(n, dtype=torch.float32, device="meta"),
                      grad=torch.empty(n, dtype=torch.float32, device="meta"),
                      numel=dev.numel + host.numel, segments=segs,
                      params=tuple(dict.fromkeys(dev.params + host.params)))


class DevicePublish:
    """The device side's values -> pinned host shards on ``stream`` ([Note: asynchronous
    device-side publish]); CUDA only."""

    def __init__(self, *, stream: torch.cuda.Stream, dtype: torch.dtype,
                 transfers: TierStats | None = None, chunk_numel: int = PUBLISH_CHUNK_NUMEL):
        self.stream, self.dtype, self.transfers = stream, dtype, transfers
        self.chunk_numel = chunk_numel
        self._staging: torch.Tensor | None = None  # allocated on ``stream``, used only there
        self._pending: dict[int, torch.cuda.Event] = {}  # group -> its copies' event
        self._last: torch.cuda.Event | None = None

    def publish(self, gi: int, host_shard: torch.Tensor,
                pieces: list[tuple[int, torch.Tensor]], after: torch.cuda.Stream) -> None:
        """Queue ``(lo, fp32 device values)`` of group ``gi`` into ``host_shard[lo:]``, after
        the work queued on ``after`` (the device step) so far."""
        wait_stream(self.stream, after)
        with on(self.stream):
            if self._staging is None:
                self._staging = torch.empty(self.chunk_numel, dtype=self.dtype,
                                            device=self.stream.device)
            for lo, values in pieces:
                n = values.numel()
                for a in range(0, n, self.chunk_numel):
                    k = min(self.chunk_numel, n - a)
                    buf = self._staging.narrow(0, 0, k)
                    buf.copy_(values.narrow(0, a, k))  # the cast, on the device
                    dst = host_shard.narrow(0, lo + a, k)
                    Copies(self.transfers).into(dst, buf, non_blocking=True)
            self._last = self._pending[gi] = record(self.stream)

    def before_fetch(self, gi: int, stream: torch.cuda.Stream | None) -> None:
        """``stream`` (the fetch's H2D copy) waits on the device for group ``gi``'s copies."""
        wait_event(stream, self._pending.pop(gi, None))

    def order_writers(self, stream: torch.cuda.Stream | None) -> None:
        """Work queued on ``stream`` from now on (writes of the device masters) runs after
        every queued copy, which reads those masters."""
        wait_event(stream, self._last)

    def settle(self) -> None:
        """Host wait for every queued copy (before host code touches the host shards)."""
        last, self._last = self._last, None
        self._pending.clear()
        if last is not None:
            with StallTimer(self.transfers):
                last.synchronize()

    @property
    def staging_bytes(self) -> int:
        return 0 if self._staging is None else self._staging.numel() * self._staging.element_size()

    def held_tensors(self) -> list[torch.Tensor]:
        return [] if self._staging is None else [self._staging]
