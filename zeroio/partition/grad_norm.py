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


CAST_PIECE = 1 << 26
"""Elements cast at once by ``cast_overflows`` (a bounded temporary)."""


def cast_overflows(grads: Iterable[torch.Tensor], dtype: torch.dtype, copies: Copies) -> bool:
    """Whether casting any of ``grads`` to ``dtype`` gives an inf or a NaN: a gradient kept on
    the device as an fp32 sum is read by the host step cast to fp16, whose range is smaller
    ([Note: the gradient window] in tiering/grad_window.py), so a finite sum can still
    overflow where it is read; the step must see that as an overflow, as it saw the cast in a
    16-bit host shard. Cast piece by piece (``CAST_PIECE``), one flag read at the end."""
    bad = None
    for g in grads:
        if g.dtype == dtype or not g.numel():
            continue
        for lo in range(0, g.numel(), CAST_PIECE):
            piece = ~torch.isfinite(g.narrow(0, lo, min(CAST_PIECE, g.numel() - lo)).to(dtype))
            bad = piece.any() if bad is None else bad | piece.any()
    return bad is not None and bool(copies.host(bad))


def shards_overflow(grads: Iterable[torch.Tensor], copies: Copies) -> bool:
    """Whether any of ``grads`` holds an inf or a NaN (one flag read per shard, stopping at the
    first that does)."""
    return any(not bool(copies.host(torch.isfinite(g).all())) for g in grads)


__all__ = ["cast_overflows", "shards_overflow", "shards_sq_norm"]
