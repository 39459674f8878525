"""Parameter shards with home NVMe, moved through the tiered store's pinned CPU tier.

Each group's shard is one named tensor (``stage3.param.<group>``) registered
with home NVMe. Only the tiered store moves its bytes: ``prefetch`` asks it to
bring the next groups' shards (per the recorded trace) into pinned host
memory in the background; ``fetch`` acquires the host copy, copies it to the
compute device on the h2d stream (pinned buffer -> device, non-blocking) and
releases it once the copy's event completes (``release(after=event)``: the
store will not reuse the buffer before), so the host never waits on the copy. The CPU tier's budget is the configured swap
buffers (``offload_param.buffer_count * buffer_size`` 16-bit elements), so no
shard stays in host memory beyond those buffers.

``update_pieces(whole=True)`` (the optimizer's publish, which replaces every
trainable element of the shard) acquires the host copy *for overwrite*: the
tiered store allocates it without reading the old shard from NVMe, so a step
reads each shard for forward and backward only, never to replace it.
"""

from __future__ import annotations

import torch

from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.partition.stage3.streams import Fetched, on, record
from zeroio.tiering import Tier, TieredStore
from zeroio.tiering.stats import StallTimer, TierStats, count_copy


def _name(key: int) -> str:
    return f"stage3.param.{key}"


class TieredShards:
    def __init__(self, settings: Stage3Settings, device: torch.device, *, rank: int,
                 transfers: TierStats | None = None):
        import os

        self.device = device
        self.transfers = transfers
        path = os.path.join(settings.nvme_path, f"stage3-params-rank{rank}")
        self.store = TieredStore(None, None, nvme_path=path, device=device if device.type == "cuda"
                                 else None, gpu_budget_bytes=0,
                                 cpu_budget_bytes=settings.host_buffer_bytes,
                                 pin_memory=settings.pin_memory)
        self._bytes: dict[int, int] = {}
        self._reading: dict[int, torch.cuda.Event] = {}  # H2D copies still reading a buffer

    def put(self, key, shard):
        self.store.register(_name(key), tuple(shard.shape), shard.dtype, home=Tier.NVME,
                            init=shard.detach().cpu())
        self._bytes[key] = shard.numel() * shard.element_size()

    def fetch(self, key, streams):
        host = self.store.acquire(_name(key), Tier.CPU)
        ready = None
        try:
            with on(streams.h2d):
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                count_copy(self.transfers, host, dev)
                dev.copy_(host, non_blocking=host.is_pinned())
                ready = record(streams.h2d)
        finally:
            self.store.release(_name(key), Tier.CPU, after=ready)
        if ready is not None:
            self._reading[key] = ready
        return Fetched(dev, ready)

    def update(self, key, values, lo):
        self.update_pieces(key, [(lo, values)], whole=False)

    def update_pieces(self, key, pieces, *, whole):
        reading = self._reading.pop(key, None)
        if reading is not None:
            with StallTimer(self.transfers):
                reading.synchronize()  # the buffer about to be written may still feed a copy
        host = self.store.acquire(_name(key), Tier.CPU, overwrite=whole)
        try:
            if whole:  # contents undefined: zero what no piece covers (padding)
                at = 0
                for lo, values in sorted(pieces, key=lambda p: p[0]):
                    if lo > at:
                        host.narrow(0, at, lo - at).zero_()
                    at = max(at, lo + values.numel())
                if at < host.numel():
                    host.narrow(0, at, host.numel() - at).zero_()
            for lo, values in pieces:
                dst = host.narrow(0, lo, values.numel())
                count_copy(self.transfers, values, dst)
                dst.copy_(values)
            if not whole:
                self.store.mark_dirty(_name(key), Tier.CPU)
        finally:
            self.store.release(_name(key), Tier.CPU)

    def prefetch(self, keys):
        self.store.prefetch([_name(k) for k in keys], Tier.CPU)

    def resident_bytes(self):
        st = self.store.stats()["tiers"]
        return {"cpu": st.get("cpu", {}).get("used_bytes", 0),
                "nvme": sum(self._bytes.values())}

    def stats(self) -> dict:
        return self.store.stats()

    def close(self):
        self.store.close()
