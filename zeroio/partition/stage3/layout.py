"""Which parameters go in which flat group, and where each element lives.

[Note: grouping]
A group is the unit of one all-gather and one reduce-scatter. The default
policy makes one group per *block*: each child of an ``nn.ModuleList`` or
``nn.ModuleDict`` (a transformer layer), holding every parameter under it.
Parameters outside any block form one group per module that registers them
(embedding, final norm, head). Parameters with fewer elements than
``stage3_param_persistence_threshold`` go to the single persistent group,
which stays gathered. A parameter registered in several modules (tied
embedding and head) belongs to the group of its first registration; every
other module registering it *uses* that group, so its hooks gather it too.

[Note: flat layout]
Inside a group, parameters are ordered by optimizer param group, then by
``named_parameters()`` order, concatenated, and padded to a multiple of the
world size; rank r owns elements ``[r*S, (r+1)*S)`` (S = padded / world).
Ordering by optimizer group makes each optimizer group's part of a shard one
contiguous run, so each becomes one ``ShardGroup`` with a contiguous master.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from zeroio.partition.base import ParamEntry, ParamIndex, Segment

PERSISTENT = "<persistent>"


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One parameter inside a group's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    global_offset: int
    opt_group: int
    """Index of the optimizer param group stepping it; -1 = frozen (no gradient, no master)."""


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    index: int
    name: str
    slots: tuple[Slot, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    persistent: bool


@dataclass(frozen=True, kw_only=True)
class ShardPiece:
    """The part of this rank's shard of one group that one optimizer group steps."""

    opt_group: int
    lo: int
    """Start inside the rank's shard."""
    hi: int
    segments: tuple[Segment, ...]
    """Offsets relative to ``lo`` -> global flat order."""
    names: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    groups: tuple[GroupPlan, ...]
    slot_of: dict[int, tuple[int, int]]
    """id(parameter) -> (group index, slot index)."""
    users: dict[str, tuple[int, ...]]
    """Name of a hooked module -> the groups its forward and backward need gathered."""


def _blocks(module: nn.Module) -> set[str]:
    out = set()
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            for child_name, child in m.named_children():
                if any(True for _ in child.parameters()):
                    out.add(f"{name}.{child_name}" if name else child_name)
    return out


def _nearest_block(name: str, blocks: set[str]) -> str | None:
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in blocks:
            return prefix
    return None


def plan_groups(
    module: nn.Module,
    *,
    world: int,
    persistence_threshold: int,
    opt_group_of: dict[int, int],
    index: ParamIndex,
    shape_of=lambda p: tuple(p.shape),
) -> Plan:
    """Group ``module``'s parameters (see [Note: grouping] and [Note: flat layout])."""
    canonical = {id(p): (n, p) for n, p in module.named_parameters()}
    offsets = index.by_name()
    blocks = _blocks(module)
    members: dict[str, list[int]] = {}
    owner: dict[int, str] = {}
    users: dict[str, list[str]] = {"": []}
    for mod_name, mod in module.named_modules():
        for p in mod._parameters.values():
            if p is None:
                continue
            hook_name = _nearest_block(mod_name, blocks)
            hook_name = mod_name if hook_name is None else hook_name
            if id(p) not in owner:
                numel = math.prod(shape_of(p))
                key = PERSISTENT if numel < persistence_threshold else hook_name
                owner[id(p)] = key
                members.setdefault(key, []).append(id(p))
            key = owner[id(p)]
            if key != PERSISTENT:
                need = users.setdefault(hook_name, [])
                if key not in need:
                    need.append(key)
    keys = list(members)
    order = {k: i for i, k in enumerate(keys)}
    groups, slot_of = [], {}
    for gi, key in enumerate(keys):
        ids = sorted(members[key], key=lambda i: opt_group_of.get(i, -1) % (1 << 30))
        slots, off = [], 0
        for si, pid in enumerate(ids):
            name, p = canonical[pid]
            shape = tuple(shape_of(p))
            slots.append(Slot(name=name, offset=off, numel=math.prod(shape), shape=shape,
                              global_offset=offsets[name].offset,
                              opt_group=opt_group_of.get(pid, -1)))
            slot_of[pid] = (gi, si)
            off += math.prod(shape)
        shard = max(1, -(-off // world))
        groups.append(GroupPlan(index=gi, name=key, slots=tuple(slots), numel=off,
                                padded_numel=shard * world, shard_numel=shard,
                                persistent=key == PERSISTENT))
    return Plan(groups=tuple(groups), slot_of=slot_of,
                users={m: tuple(order[k] for k in ks) for m, ks in users.items()})


def shard_pieces(group: GroupPlan, rank: int) -> list[ShardPiece]:
    """This rank's shard of ``group`` cut into one contiguous run per optimizer group."""
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    runs: dict[int, list[tuple[int, int, int, str]]] = {}
    for s in group.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b and s.opt_group >= 0:
            runs.setdefault(s.opt_group, []).append((a - lo, s.global_offset + a - s.offset,
                                                      b - a, s.name))
    pieces = []
    for og, run in runs.items():
        start, end = run[0][0], run[-1][0] + run[-1][2]
        segs = tuple(Segment(local_offset=lo_ - start, global_offset=g, numel=n)
                     for lo_, g, n, _ in run)
        pieces.append(ShardPiece(opt_group=og, lo=start, hi=end, segments=segs,
                                 names=tuple(nm for *_, nm in run)))
    return pieces


def index_of(module: nn.Module, shape_of=lambda p: tuple(p.shape)) -> ParamIndex:
    """``ParamIndex.from_module`` with true shapes (parameters may already be partitioned)."""
    entries, offset = [], 0
    for name, p in module.named_parameters():
        shape = tuple(shape_of(p))
        n = math.prod(shape)
        entries.append(ParamEntry(name=name, offset=offset, shape=shape, numel=n))
        offset += n
    return ParamIndex(entries=tuple(entries), total_numel=offset)
