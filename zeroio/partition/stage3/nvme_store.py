"""Parameter shards with home NVMe, moved through the tiered store's pinned CPU tier.

Each group's shard is one named tensor (``stage3.param.<group>``) registered
with home NVMe. Only the tiered store moves its bytes: ``prefetch`` asks it to
bring the next groups' shards (per the recorded trace) into pinned host
memory in the background; ``fetch`` acquires the host copy, copies it to the
compute device and releases it. The CPU tier's budget is the configured swap
buffers (``offload_param.buffer_count * buffer_size`` 16-bit elements), so no
shard stays in host memory beyond those buffers.
"""

from __future__ import annotations

import torch

from zeroio.partition.stage3.settings import Stage3Settings
from zeroio.tiering import TieredStore, Tier


def _name(key: int) -> str:
    return f"stage3.param.{key}"


class TieredShards:
    def __init__(self, settings: Stage3Settings, device: torch.device, *, rank: int):
        import os

        self.device = device
        path = os.path.join(settings.nvme_path, f"stage3-params-rank{rank}")
        self.store = TieredStore(None, None, nvme_path=path, device=device if device.type == "cuda"
                                 else None, gpu_budget_bytes=0,
                                 cpu_budget_bytes=settings.host_buffer_bytes,
                                 pin_memory=settings.pin_memory)
        self._bytes: dict[int, int] = {}

    def put(self, key, shard):
        self.store.register(_name(key), tuple(shard.shape), shard.dtype, home=Tier.NVME,
                            init=shard.detach().cpu())
        self._bytes[key] = shard.numel() * shard.element_size()

    def fetch(self, key):
        host = self.store.acquire(_name(key), Tier.CPU)
        try:
            # a blocking copy: the host buffer may be reused as soon as it is released
            return host.to(self.device, copy=True)
        finally:
            self.store.release(_name(key), Tier.CPU)

    def update(self, key, values, lo):
        host = self.store.acquire(_name(key), Tier.CPU)
        try:
            host.narrow(0, lo, values.numel()).copy_(values)
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
