"""The two collectives a checkpoint needs: who am I, and did every rank succeed.

`all_ok` is used instead of a bare barrier so that a rank whose write failed
(ENOSPC, a bad segment) still joins the collective and every rank raises,
instead of the others waiting for it until the process-group timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Comm:
    rank: int = 0
    world_size: int = 1
    group: Any = None
    device: torch.device | None = None  # where the flag tensor lives (cuda for NCCL)

    @classmethod
    def default(cls, group: Any = None) -> Comm:
        """The initialised torch.distributed world (or ``group``), else a single process."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        device = None
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(dist.get_rank(group), dist.get_world_size(group), group, device)

    def all_ok(self, ok: bool) -> bool:
        """True when every rank passed ``ok=True``; a barrier as well."""
        if self.world_size == 1:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def broadcast_text(self, text: str | None, src: int = 0) -> str:
        """Rank ``src``'s string on every rank (utf-8 bytes in a uint8 tensor; no pickle)."""
        if self.world_size == 1:
            return text or ""
        import torch.distributed as dist

        data = (text or "").encode() if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src, group=self.group)
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src, group=self.group)
        return bytes(buf.cpu().numpy()).decode()
