"""Parameter shards read from the optimizer's masters: no 16-bit copy is kept.

[Note: shards read from the master]
With ``zero_optimization.tiering.params_from_master`` stage 3 keeps no 16-bit
parameter shard (FSDP2's mixed precision keeps only the sharded fp32 parameter
and casts when it all-gathers). ``MasterShards.fetch`` builds the shard on the
compute device from the master pieces of that group (the partitioner's
``_PieceRef``s, bound by ``attach`` before the first ``put``):

- a master in host memory (the host side of the optimizer, pinned when CUDA is
  present): an H2D copy of the fp32 (bf16 with bf16 masters) slice on the
  ``h2d`` stream into a device staging tensor, then the cast into the shard on
  the same stream (4 bytes per element cross PCIe instead of 2);
- a master on the compute device (offload_optimizer none, or the device side of
  ``offload_optimizer.ratio``): the cast, on the ``h2d`` stream;
- elements no piece covers are padding: zero (a group holding a parameter outside
  every optimizer group is not attached: its 16-bit shard stays in the inner store).

The values are exactly the old shard's: the publish cast the master with the same
round-to-nearest-even ``copy_``. ``update`` / ``update_pieces`` copy nothing (the
master is the truth); they keep the order the readers rely on:

- a master written on a CUDA stream (the device step, a GPU Adam) is read by the
  fetch only after that write: ``update`` of device values records an event on the
  caller's stream and the next fetch's ``h2d`` work waits on it;
- a host master is written by the CPU optimizer only after the copies reading it
  are done: every fetch records its event, and ``settle_reads`` (called where the
  partitioner hands the masters to a writer: ``finalize_gradients``, ``wait_step``,
  which the host step, a checkpoint load, ``write_back`` and ``close`` go through)
  waits for the last one on the host; ``order_writers`` makes a stream that writes
  device masters wait for it on the device;
- under the overlapped step each group's fetch waits for that group's job first
  (``ParamGroup.before_fetch``, [Note: stage-3 host step]), so it reads the updated
  master; the jobs of other groups write other ranges of the masters.

Persistent groups (small parameters kept gathered) and groups that are not
attached live in ``inner`` (the store ``offload_param.device`` names) as before.
On a CPU compute device the fetch is a cast into a new tensor.
"""

from __future__ import annotations

import torch

from zeroio.partition.stage3.store import ShardStore
from zeroio.partition.stage3.streams import Fetched, Streams, on, record, wait_event
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats


class MasterShards:
    """A ``ShardStore`` whose attached groups are cast from their master pieces (see the note)."""

    def __init__(self, inner: ShardStore, device: torch.device, dtype: torch.dtype,
                 transfers: TierStats | None = None):
        self.inner, self.device, self.dtype, self.transfers = inner, device, dtype, transfers
        self._pieces: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._numel: dict[int, int] = {}
        self._written: dict[int, torch.cuda.Event] = {}  # last device write of a group's masters
        self._last_read: torch.cuda.Event | None = None  # the last fetch's copies (h2d, in order)

    # -- binding ----------------------------------------------------------------------------
    def attach(self, key: int, shard_numel: int, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """Group ``key``'s shard is ``pieces`` (``(lo, master view)``, disjoint, inside
        ``[0, shard_numel)``) and zeros elsewhere; call before its ``put``."""
        for lo, m in pieces:
            if lo < 0 or lo + m.numel() > shard_numel:
                raise ValueError(f"master piece [{lo}, {lo + m.numel()}) of group {key} is "
                                 f"outside its shard of {shard_numel} elements")
        self._pieces[key] = sorted(pieces, key=lambda p: p[0])
        self._numel[key] = shard_numel

    def attached(self, key: int) -> bool:
        return key in self._pieces

    # -- ShardStore -------------------------------------------------------------------------
    def put(self, key, shard):
        if key in self._pieces:
            if shard.numel() != self._numel[key]:
                raise ValueError(f"group {key}: shard of {shard.numel()} elements, attached "
                                 f"{self._numel[key]}")
            return  # the masters hold the values
        self.inner.put(key, shard)

    def fetch(self, key, streams: Streams):
        if key not in self._pieces:
            return self.inner.fetch(key, streams)
        cuda = self.device.type == "cuda"
        with on(streams.h2d):
            wait_event(streams.h2d, self._written.pop(key, None))  # the device step's writes
            out = torch.empty(self._numel[key], dtype=self.dtype, device=self.device)
            at = 0
            for lo, master in self._pieces[key]:
                if lo > at:
                    out.narrow(0, at, lo - at).zero_()
                dst = out.narrow(0, lo, master.numel())
                if cuda and master.device.type == "cpu":
                    staged = Copies(self.transfers).new(master, self.device,
                                                        non_blocking=master.is_pinned())
                    dst.copy_(staged)  # the cast, on the device (staged lives on h2d only)
                else:
                    dst.copy_(master)
                at = lo + master.numel()
            if at < out.numel():
                out.narrow(0, at, out.numel() - at).zero_()
            ready = record(streams.h2d) if cuda else None
        if ready is not None:
            self._last_read = ready
        return Fetched(out, ready)

    def update(self, key, values, lo):
        if key not in self._pieces:
            self.inner.update(key, values, lo)
        elif values.device.type == "cuda":
            self._written[key] = record(torch.cuda.current_stream(values.device))

    def update_pieces(self, key, pieces, *, whole):
        if key not in self._pieces:
            self.inner.update_pieces(key, pieces, whole=whole)
            return
        for lo, values in pieces:
            self.update(key, values, lo)

    def prefetch(self, keys):
        self.inner.prefetch([k for k in keys if k not in self._pieces])

    def resident_bytes(self):
        return self.inner.resident_bytes()

    def held_tensors(self):
        return self.inner.held_tensors()  # the masters are the optimizer's, counted there

    def close(self):
        self.settle_reads()
        self._pieces.clear()
        self.inner.close()

    # -- ordering against writers of the masters --------------------------------------------
    def order_writers(self, stream: torch.cuda.Stream | None) -> None:
        """Work queued on ``stream`` from now on (writes of device masters) runs after every
        fetch's copies, which read the masters."""
        wait_event(stream, self._last_read)

    def settle_reads(self) -> None:
        """Host wait until no fetch still reads a master (before host code writes them)."""
        last, self._last_read = self._last_read, None
        if last is not None:
            with StallTimer(self.transfers):
                last.synchronize()
