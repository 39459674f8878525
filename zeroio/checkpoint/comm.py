"""The two collectives a checkpoint needs: who am I, and did every rank succeed.

`all_ok` is used instead of a bare barrier so that a rank whose write failed
(ENOSPC, a bad segment) still joins the collective and every rank raises,
instead of the others waiting for it until the process-group timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeroio.partition import collectives


@dataclass(frozen=True)
class Comm:
    rank: int = 0
    world_size: int = 1
    group: Any = None
    device: torch.device | None = None  # where the flag tensor lives (cuda for NCCL)

    @classmethod
    def default(cls, group: Any = None) -> Comm:
        """The joined process group's world (or ``group``'s), else a single process."""
        w = collectives.world(group)
        if w.backend is None:
            return cls()
        device = torch.device("cuda", torch.cuda.current_device()) if w.nccl else None
        return cls(w.rank, w.world_size, group, device)

    def all_ok(self, ok: bool) -> bool:
        """True when every rank passed ``ok=True``; a barrier as well."""
        if self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        collectives.all_reduce_scalar(flag, self.group, op="min")
        return bool(flag.item())

    def broadcast_text(self, text: str | None, src: int = 0) -> str:
        """Rank ``src``'s string on every rank (utf-8 bytes in a uint8 tensor; no pickle)."""
        if self.world_size == 1:
            return text or ""
        data = (text or "").encode() if self.rank == src else b""
        return collectives.broadcast_bytes(data, src, self.group, self.device).decode()
