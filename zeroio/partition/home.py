"""Where a partitioner's fp32 master and gradient shards live (``ShardHome``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroio.io.hostmem import host_zeros


@dataclass(frozen=True, kw_only=True)
class ShardHome:
    """Where this rank's fp32 master and gradient shards live (policy, not a flag)."""

    device: torch.device
    pin_memory: bool = False
    host: bool = False
    """The host tier (an offloaded optimizer's shards): allocated by zeroio.io.hostmem, which
    counts them (``live_bytes``); the compute device's otherwise, a CPU device's included."""

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.host:  # see zeroio.io.hostmem.[Note: host memory]
            return host_zeros(numel, dtype, pin=self.pin_memory)
        return torch.zeros(numel, dtype=dtype, device=self.device)


def host_home(pin_memory: bool) -> ShardHome:
    return ShardHome(device=torch.device("cpu"), host=True,
                     pin_memory=pin_memory and torch.cuda.is_available())
