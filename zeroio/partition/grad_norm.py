"""The local squared gradient norm and overflow flag of a rank's gradient shards, read to
the host.

Stage 1/2 and stage 3 compute them the same way: the norm, when the reduction did not take
its parts on the fly, from each shard's norm in fp32 (as torch's ``clip_grad_norm_``),
squared in float64 without a float64 copy of the shard; the flag from each shard's
``isfinite``. Each scalar comes to the host through the partitioner's copy handle, so its
bytes are counted like every other host <-> device copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroio.tiering.copies import Copies


def shards_sq_norm(grads: Iterable[torch.Tensor], copies: Copies, *,
                   divisor: float = 1.0) -> torch.Tensor:
    """Sum of the squared norms of ``grads`` as a host fp32 scalar; ``divisor``: what each
    norm is divided by first (stage 1/2's unaveraged host gradients: the world size)."""
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if g.numel():
            norm = torch.linalg.vector_norm(g, dtype=torch.float32)
            if divisor != 1.0:
                norm = norm / divisor
            total += copies.host(norm.double().pow(2).float())
    return total


def shards_overflow(grads: Iterable[torch.Tensor], copies: Copies) -> bool:
    """Whether any of ``grads`` holds an inf or a NaN (one flag read per shard, stopping at the
    first that does)."""
    return any(not bool(copies.host(torch.isfinite(g).all())) for g in grads)


__all__ = ["shards_overflow", "shards_sq_norm"]
