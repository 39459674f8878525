"""Flat contiguous buffers for stage 0/1/2: layout, bucket-wise sharding, parameter views.

[Note: bucket-wise sharding]
Each optimizer param group's parameters (in global flat order) are cut into
buckets of about ``reduce_bucket_size`` elements at parameter boundaries.
Each bucket is padded to a multiple of the partition world and split into
equal slices: rank r owns slice r of every bucket. A reduce-scatter or
all-gather of a bucket is then one collective on one contiguous range of a
flat buffer, with no copy in or out, and any world size works. A rank's shard
of a group is the concatenation of its slices, mapped to the global flat
order by ``Segment``s (the padding has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroio.partition.base import ParamIndex, Segment, ShardGroup
from zeroio.tiering.copies import Copies


@dataclass(frozen=True, kw_only=True, eq=False)
class ParamSlot:
    param: torch.nn.Parameter
    name: str
    flat_offset: int
    """Start in the flat buffers."""
    global_offset: int
    """Start in the global flat order."""
    numel: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Bucket:
    index: int
    group_index: int
    start: int
    """Start in the flat buffers."""
    numel: int
    """Padded length: a multiple of the partition world."""
    slots: tuple[ParamSlot, ...]

    def slice_numel(self, world: int) -> int:
        return self.numel // world

    def my_segments(self, rank: int, world: int, local_base: int) -> list[Segment]:
        """Segments of this rank's slice, local offsets starting at ``local_base``."""
        size = self.slice_numel(world)
        lo, hi = self.start + rank * size, self.start + (rank + 1) * size
        out = []
        for s in self.slots:
            a, b = max(lo, s.flat_offset), min(hi, s.flat_offset + s.numel)
            if a < b:
                out.append(Segment(
                    local_offset=local_base + (a - lo),
                    global_offset=s.global_offset + (a - s.flat_offset),
                    numel=b - a,
                ))
        return out


@dataclass(frozen=True, kw_only=True)
class FlatLayout:
    buckets: tuple[Bucket, ...]
    total_numel: int
    world: int
    """Partition world: slices per bucket (1 for stage 0)."""

    def group_buckets(self, group_index: int) -> list[Bucket]:
        return [b for b in self.buckets if b.group_index == group_index]


def build_layout(
    module: torch.nn.Module,
    param_groups: list[list[torch.nn.Parameter]],
    index: ParamIndex,
    bucket_numel: int,
    world: int,
) -> FlatLayout:
    """Buckets per param group, parameters in global flat order (see [Note: bucket-wise sharding])."""
    by_name = index.by_name()
    name_of = {id(p): n for n, p in module.named_parameters()}
    buckets: list[Bucket] = []
    cursor = 0
    for gi, params in enumerate(param_groups):
        ordered = sorted(params, key=lambda p: by_name[name_of[id(p)]].offset)
        pending: list[torch.nn.Parameter] = []

        def close(pending=pending, gi=gi):
            nonlocal cursor
            if not pending:
                return
            used = sum(p.numel() for p in pending)
            padded = -(-used // world) * world
            slots, off = [], cursor
            for p in pending:
                name = name_of[id(p)]
                slots.append(ParamSlot(param=p, name=name, flat_offset=off,
                                       global_offset=by_name[name].offset, numel=p.numel()))
                off += p.numel()
            buckets.append(Bucket(index=len(buckets), group_index=gi, start=cursor,
                                  numel=padded, slots=tuple(slots)))
            cursor += padded
            pending.clear()

        filled = 0
        for p in ordered:
            if pending and filled + p.numel() > bucket_numel:
                close()
                filled = 0
            pending.append(p)
            filled += p.numel()
        close()
    return FlatLayout(buckets=tuple(buckets), total_numel=cursor, world=world)


def flatten_into_views(
    layout: FlatLayout, dtype: torch.dtype, device: torch.device, copies: Copies
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the flat parameter and gradient buffers and make every parameter a view.

    Parameter values are copied in through ``copies`` (cast to ``dtype``; they cross only
    when the model is not on ``device`` yet); each parameter's
    ``.data`` becomes a view of the parameter buffer and its ``.grad`` a view
    of the gradient buffer, so autograd accumulates straight into the buffer
    that the collectives read."""
    params = torch.zeros(layout.total_numel, dtype=dtype, device=device)
    grads = torch.zeros(layout.total_numel, dtype=dtype, device=device)
    for b in layout.buckets:
        for s in b.slots:
            view = params.narrow(0, s.flat_offset, s.numel).view_as(s.param)
            copies.into(view, s.param.detach())
            s.param.data = view
            s.param.grad = grad_view(grads, s)
    return params, grads


def grad_view(grads: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    return grads.narrow(0, slot.flat_offset, slot.numel).view_as(slot.param)


def shard_group(gi: int, segments: list[Segment], master: torch.Tensor, grad: torch.Tensor,
                slots) -> ShardGroup:
    """The ShardGroup of ``segments`` of optimizer group ``gi``, naming the parameters of
    ``slots`` with elements in them."""
    names = tuple(dict.fromkeys(
        s.name for s in slots
        if any(seg.global_offset < s.global_offset + s.numel
               and s.global_offset < seg.global_offset + seg.numel for seg in segments)))
    return ShardGroup(group_index=gi, master=master, grad=grad,
                      numel=sum(s.numel for s in segments), segments=tuple(segments),
                      params=names)
