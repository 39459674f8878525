"""Where this rank's parameter shards live between uses: one policy class per home.

A store keeps one 1-D shard per group (compute dtype, ``shard_numel`` long)
and hands it to the gather on the compute device. The group never knows the
home; ``offload_param.device`` picks the class (``make_store``).

- ``DeviceShards`` (none): shards stay on the compute device.
- ``HostShards`` (cpu): shards in (pinned) host memory, copied to the device
  on the h2d stream just before the all-gather ([Note: stage-3 streams]).
- ``TieredShards`` (nvme): shards registered in the tiered store with home
  NVMe, except up to ``offload_param.max_in_cpu`` elements kept in host memory;
  ``prefetch`` asks it to bring the next groups' shards to pinned CPU ahead of use (the
  recorded module order), ``fetch`` acquires and copies.

Every copy between host and device is counted where it is issued in the
partitioner's ``TierStats`` (``transfers``), and every host wait on a copy is
stall time; ``update_pieces(whole=True)`` lets a store replace a shard
without reading it first (the NVMe store's acquire for overwrite).

``fetch`` returns a ``Fetched``: the shard on the device and the event its copy
(or its last update) completes with; the gather's comm stream waits on it. A
host buffer an in-flight H2D copy reads is not written (``update``) or reused
before that copy's event completes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zeroio.io.hostmem import host_empty
from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.partition.stage3.streams import Fetched, Streams, on, record
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import StallTimer, TierStats


class ShardStore(Protocol):
    def put(self, key: int, shard: torch.Tensor) -> None:
        """Take ownership of the initial shard (any device; copied to the home)."""

    def fetch(self, key: int, streams: Streams) -> Fetched:
        """The shard on the compute device and the event its copy completes with."""

    def update(self, key: int, values: torch.Tensor, lo: int) -> None:
        """Overwrite elements ``[lo, lo+n)`` of the shard, converting dtype as needed."""

    def update_pieces(self, key: int, pieces: list[tuple[int, torch.Tensor]], *,
                      whole: bool) -> None:
        """``update`` for each ``(lo, values)``. ``whole``: the pieces replace every element
        that matters (the rest is padding, zeroed), so the old shard need not be read."""

    def prefetch(self, keys: list[int]) -> None:
        """Start moving these shards toward the compute device (no-op where they already are)."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of shards held per place: {"device": n, "cpu": n, "nvme": n}."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Shards held outside a tiered store (``engine.stats()["tiers"]``; a store reports its own)."""

    def order_writers(self, stream: torch.cuda.Stream | None) -> None:
        """Work queued on ``stream`` from now on (writes of the fp32 masters) runs after every
        copy a fetch queued that reads them. A no-op for stores whose shards are their own
        copies; ``MasterShards`` reads the masters themselves."""

    def settle_reads(self) -> None:
        """Host wait until no fetch still reads a master (before host code writes them); a
        no-op where fetches never read the masters."""

    def close(self) -> None: ...


class OwnCopies:
    """``order_writers`` / ``settle_reads`` of a store whose shards are copies of its own: no
    fetch reads the masters, so writers of the masters need no ordering against fetches."""

    def order_writers(self, stream: torch.cuda.Stream | None) -> None:
        pass

    def settle_reads(self) -> None:
        pass


def update_each(store: ShardStore, key: int, pieces: list[tuple[int, torch.Tensor]]) -> None:
    for lo, values in pieces:
        store.update(key, values, lo)


class DeviceShards(OwnCopies):
    def __init__(self, device: torch.device, transfers: TierStats | None = None):
        self.device = device
        self.transfers = transfers
        self._shards: dict[int, torch.Tensor] = {}
        self._written: dict[int, torch.cuda.Event | None] = {}  # last update, on compute

    def put(self, key, shard):
        self._shards[key] = Copies(self.transfers).to(shard, self.device).contiguous()

    def fetch(self, key, streams):
        return Fetched(self._shards[key], self._written.pop(key, None))

    def update(self, key, values, lo):
        dst = self._shards[key].narrow(0, lo, values.numel())
        Copies(self.transfers).into(dst, values, non_blocking=True)
        if self.device.type == "cuda":
            self._written[key] = record(torch.cuda.current_stream(self.device))

    def update_pieces(self, key, pieces, *, whole):
        update_each(self, key, pieces)

    def prefetch(self, keys):
        pass

    def resident_bytes(self):
        n = sum(t.numel() * t.element_size() for t in self._shards.values())
        return {"device" if self.device.type != "cpu" else "cpu": n}

    def held_tensors(self):
        return list(self._shards.values())

    def close(self):
        self._shards.clear()


class HostShards(OwnCopies):
    def __init__(self, device: torch.device, pin: bool, transfers: TierStats | None = None):
        self.device = device
        self.transfers = transfers
        self.pin = pin and torch.cuda.is_available()
        self._shards: dict[int, torch.Tensor] = {}
        self._reading: dict[int, torch.cuda.Event] = {}  # H2D copies still reading a host shard

    def put(self, key, shard):
        host = host_empty(shard.numel(), shard.dtype, pin=self.pin).view(shard.shape)
        Copies(self.transfers).into(host, shard)
        self._shards[key] = host

    def fetch(self, key, streams):
        host = self._shards[key]
        if self.device.type == "cpu":
            return Fetched(host, None)
        with on(streams.h2d):
            dev = Copies(self.transfers).new(host, self.device, non_blocking=self.pin)
            ready = record(streams.h2d)
        if ready is not None:
            self._reading[key] = ready
        return Fetched(dev, ready)

    def update(self, key, values, lo):
        dst = self.writable(key, lo, values.numel())
        Copies(self.transfers).into(dst, values)

    def writable(self, key, lo: int, numel: int) -> torch.Tensor:
        """Elements ``[lo, lo+numel)`` of the host shard, for a writer that fills them itself
        (the one-pass CPU Adam); waits until no copy in flight reads the shard."""
        reading = self._reading.pop(key, None)
        if reading is not None:
            with StallTimer(self.transfers):
                reading.synchronize()  # an async copy may still read the old bytes
        return self._shards[key].narrow(0, lo, numel)

    def update_pieces(self, key, pieces, *, whole):
        update_each(self, key, pieces)

    def host_shard(self, key) -> torch.Tensor:
        """The pinned host shard itself, for a writer that orders its own copies against
        ``fetch`` (the stage-3 device-side publish, [Note: asynchronous device-side publish]
        in twin.py)."""
        return self._shards[key]

    def prefetch(self, keys):
        pass

    def resident_bytes(self):
        return {"cpu": sum(t.numel() * t.element_size() for t in self._shards.values())}

    def held_tensors(self):
        return list(self._shards.values())

    def close(self):
        self._shards.clear()


def make_store(settings: Stage3Settings, device: torch.device, *, rank: int,
               shard_numels: dict[int, int], dtype: torch.dtype,
               transfers: TierStats | None = None) -> ShardStore:
    """``shard_numels``: every group's shard length by key, known before any ``put`` (the NVMe
    store picks the shards it keeps in host memory from them, ``offload_param.max_in_cpu``)."""
    if settings.offload_device == "none":
        return DeviceShards(device, transfers)
    if settings.offload_device == "cpu":
        return HostShards(device, settings.pin_memory, transfers)
    from zeroio.partition.stage3.nvme_store import TieredShards

    return TieredShards(settings, device, rank=rank, shard_numels=shard_numels, dtype=dtype,
                        transfers=transfers)
