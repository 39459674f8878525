"""The only module of the partition layer that calls torch.distributed.

Every collective is a free function taking explicit tensors and group and
returning a ``CommHandle`` that carries the work object; the consumer calls
``wait()``. With NCCL the collective runs on the process group's own stream
(``async_op=True``), so it overlaps the compute stream until ``wait()`` makes
the current stream wait on it; with gloo the work runs on gloo's threads.

[Note: gloo fallbacks]
gloo has no reduce-scatter and (depending on the build) no
``all_gather_into_tensor``. The fallbacks here keep the same in-place
contract: ``reduce_scatter_inplace`` all-reduces the whole bucket (the
caller reads only its slice), ``all_gather_inplace`` gathers into a list of
slices of the same buffer. Only this module knows which backend runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(eq=False)
class CommHandle:
    """An in-flight collective; ``wait()`` is idempotent and runs ``after`` once."""

    work: object | None
    after: Callable[[], None] | None = None
    _done: bool = field(default=False)

    def wait(self) -> None:
        if self._done:
            return
        if self.work is not None:
            self.work.wait()
        if self.after is not None:
            self.after()
        self._done = True


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> CommHandle:
    """Sum ``tensor`` over ranks in place, asynchronously."""
    if world_size(group) == 1:
        return CommHandle(None)
    return CommHandle(dist.all_reduce(tensor, op=op, group=group, async_op=True))


def reduce_scatter_inplace(bucket: torch.Tensor, group=None) -> CommHandle:
    """Sum ``bucket`` over ranks; afterwards this rank's equal slice of it holds the sum.

    ``bucket.numel()`` must be a multiple of the world size. The other slices
    are left undefined (NCCL) or also reduced (gloo fallback)."""
    world = world_size(group)
    if world == 1:
        return CommHandle(None)
    if not _is_nccl(group):
        return CommHandle(dist.all_reduce(bucket, group=group, async_op=True))
    shard = bucket.numel() // world
    out = bucket.narrow(0, rank(group) * shard, shard)
    return CommHandle(dist.reduce_scatter_tensor(out, bucket, group=group, async_op=True))


def all_gather_inplace(buffer: torch.Tensor, group=None) -> CommHandle:
    """Fill ``buffer`` from every rank's equal slice of it (this rank's slice is the input)."""
    world = world_size(group)
    if world == 1:
        return CommHandle(None)
    shard = buffer.numel() // world
    mine = buffer.narrow(0, rank(group) * shard, shard)
    if _is_nccl(group):
        return CommHandle(dist.all_gather_into_tensor(buffer, mine, group=group, async_op=True))
    # gloo: a private copy of the input, since the outputs alias it (see [Note: gloo fallbacks])
    outs = list(buffer.split(shard))
    return CommHandle(dist.all_gather(outs, mine.clone(), group=group, async_op=True))


def all_reduce_scalar(value: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Blocking all-reduce of a small tensor (norms, overflow flags); returns it."""
    if world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


def broadcast(tensor: torch.Tensor, src: int, group=None) -> CommHandle:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (global rank), asynchronously."""
    if world_size(group) == 1:
        return CommHandle(None)
    return CommHandle(dist.broadcast(tensor, src=src, group=group, async_op=True))
