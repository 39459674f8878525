"""The contract between the engine and a partitioner (stage 0/1/2 or stage 3).

The engine drives a partitioner through ``Partitioner`` and steps the
``ShardGroup``s it exposes; it never looks at how parameters or gradients are
split. The checkpoint layer reads and writes the same ``ShardGroup``s through
their ``segments`` map.

[Note: global flat order]
The global flat order is the parameters of ``model.named_parameters()``
(tied ones once), each flattened, concatenated, unpadded. ``ParamIndex``
records name -> (offset, shape) in it. Frozen parameters (not in any optimizer
param group) keep their place in the index but belong to no ShardGroup.

[Note: local layout]
A ShardGroup's local tensors (``master``, ``grad``) are 1-D and ``numel``
long (plus ``padded_numel - numel`` trailing padding a partitioner may use to
make every rank's shard equally long). Which global elements live where is
given only by ``segments``: sorted by ``local_offset``, disjoint, each a run of
``numel`` elements that are contiguous both locally and globally. A
partitioner may lay its shard out in any order (stage 2 uses bucket-wise
slices), so nothing may assume local offset == global offset - base.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroio.partition.stage3.twin import OptimizerSplit


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A run of elements contiguous in this rank's shard and in the global flat order."""

    local_offset: int
    """Start inside the ShardGroup's local tensors."""
    global_offset: int
    """Start in the global flat order (see [Note: global flat order])."""
    numel: int


@dataclass(frozen=True, kw_only=True)
class ParamEntry:
    name: str
    offset: int
    """Start of this parameter in the global flat order."""
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True, kw_only=True)
class ParamIndex:
    """name -> (offset, shape) over the global flat order; identical on every rank."""

    entries: tuple[ParamEntry, ...]
    total_numel: int

    def by_name(self) -> dict[str, ParamEntry]:
        return {e.name: e for e in self.entries}

    def to_json(self) -> dict:
        return {
            "total_numel": self.total_numel,
            "params": {e.name: {"offset": e.offset, "shape": list(e.shape)} for e in self.entries},
        }

    @staticmethod
    def from_module(module: torch.nn.Module) -> ParamIndex:
        entries, offset = [], 0
        for name, p in module.named_parameters():  # named_parameters() drops tied duplicates
            entries.append(ParamEntry(name=name, offset=offset, shape=tuple(p.shape), numel=p.numel()))
            offset += p.numel()
        return ParamIndex(entries=tuple(entries), total_numel=offset)


@dataclass(eq=False, kw_only=True)
class ShardGroup:
    """This rank's part of one optimizer param group.

    ``master`` and ``grad`` are fp32 and live where the optimizer steps them
    (GPU, pinned CPU). With NVMe offload the optimizer keeps ``master`` in the
    tiered store between steps and ``master`` here is the resident copy the
    optimizer hands back after the step (see ``zeroio/optim``).
    """

    group_index: int
    """Index of the optimizer param group whose hyperparameters apply."""
    master: torch.Tensor
    """fp32 master weights of this shard, 1-D, ``padded_numel`` long."""
    grad: torch.Tensor
    """fp32 gradient of this shard: reduced, averaged over ranks, summed over the accumulation
    micro steps and divided by their number. Valid after ``finalize_gradients(boundary=True)``.
    Exception: at stages 1/2 with the one-pass CPU Adam (optim/cpu_adam.py) and no host
    accumulation it is the 16-bit reduced gradient *not* divided by the world size; the
    optimizer's ``grad_divisor`` applies that (stage12.py, ``host_grad_dtype``)."""
    numel: int
    """Elements that belong to parameters (the rest of ``padded_numel`` is padding, kept zero)."""
    segments: tuple[Segment, ...]
    """Local offset -> global flat order map (see [Note: local layout])."""
    params: tuple[str, ...] = field(default=())
    """Names of the parameters with elements in this shard."""

    @property
    def padded_numel(self) -> int:
        return self.master.numel()

    def global_ranges(self) -> list[tuple[int, int]]:
        """(global_offset, numel) of every segment, in local order."""
        return [(s.global_offset, s.numel) for s in self.segments]


class Phase(enum.Enum):
    """Where a partitioner is in the accumulation cycle."""

    IDLE = "idle"                  # gradients zero, nothing in flight
    ACCUMULATING = "accumulating"  # inside a micro step's backward, reductions may be in flight
    REDUCED = "reduced"            # boundary reached; ShardGroup.grad final for this step
    STEPPED = "stepped"            # masters updated; params not yet published


class Partitioner:
    """The base of every partitioner: what the engine calls, in this order, each optimizer
    step, and the defaults a partitioner that lacks a capability inherits (so the engine
    never probes with getattr/hasattr):

    for each micro step:  ``begin_micro_step(boundary)`` -> user forward ->
        ``loss.backward()`` (hooks reduce buckets as they fill) ->
        ``finalize_gradients(boundary)``
    at the boundary:  ``local_grad_sq_norm()`` / ``local_overflow()`` ->
        optimizer steps ``groups`` (or skips), in one of three ways: ``run_step`` (host
        masters stepped chunk by chunk, ``runs_host_step``), the optimizer's ``step`` with
        ``stage_range`` then ``publish_params(staged=True)`` (``stages_ranges``), or the
        optimizer's ``step`` then ``publish_params()`` -> ``zero_grad()``.
    ``wait_step()`` finishes an overlapped step before anything reads parameters or state.
    """

    stage: int
    groups: list[ShardGroup]
    """The logical ShardGroups the optimizer steps and checkpoints read."""
    index: ParamIndex

    optimizer_split: OptimizerSplit | None = None
    """``offload_optimizer.ratio`` < 1: the device and host sides' physical ShardGroups
    (the engine builds a ``TwinAdam`` over them); None: one optimizer over ``groups``."""
    host_grad_divisor: float = 1.0
    """What the host optimizer divides gradients by on top of the loss scale (stage 1/2's
    16-bit host gradients are not averaged over ranks yet); 1.0: already averaged."""
    store: object | None = None
    """The partitioner's parameter store (stage 3), None where it keeps none."""
    runs_host_step: bool = False
    """Whether ``run_step`` can run the host optimizer step chunk by chunk."""
    stages_ranges: bool = False
    """Whether ``stage_range`` publishes updated ranges while the optimizer steps."""

    def begin_micro_step(self, boundary: bool) -> None:
        """Arm hooks for one backward; ``boundary`` says whether it ends the accumulation."""
        raise NotImplementedError

    def finalize_gradients(self, boundary: bool) -> None:
        """After a backward: launch any unfired bucket, wait for reductions, and at the boundary
        leave every ``ShardGroup.grad`` final (averaged over world and accumulation)."""
        raise NotImplementedError

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp32 scalar tensor on the comm device).
        The engine all-reduces it for the global norm; shards are disjoint so nothing double counts."""
        raise NotImplementedError

    def local_overflow(self) -> bool:
        """Whether any of this rank's gradient shards holds inf/nan (fp16 loss scaling)."""
        raise NotImplementedError

    def publish_params(self, staged: bool = False) -> None:
        """Copy updated masters into the model's compute parameters on every rank
        (``staged``: the ranges ``stage_range`` staged during the step)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear gradients (local shards and any model .grad) for the next accumulation."""
        raise NotImplementedError

    def run_step(self, update, *, out_in_pass: bool = False, step=None) -> None:
        """Run the host optimizer step chunk by chunk (``update(group, lo, numel, ...)``),
        each chunk published behind it (``runs_host_step``)."""
        raise NotImplementedError(f"{type(self).__name__} has no chunked host step")

    def stage_range(self, group_index: int, start: int, numel: int) -> None:
        """The optimizer updated ``numel`` masters of group ``group_index`` from ``start``:
        stage them for publication (``stages_ranges``)."""
        raise NotImplementedError(f"{type(self).__name__} does not stage ranges")

    def wait_step(self) -> None:
        """Finish an overlapped optimizer step (``zero_optimization.tiering.overlap_step``);
        default: steps never overlap, nothing to wait for."""

    def stats_sources(self) -> dict[str, dict]:
        """Counter sources for ``engine.stats()`` (tiering/stats.py); default: none."""
        return {}

    def held_tensors(self) -> list[torch.Tensor]:
        """What this partitioner keeps in memory outside any tiered store ([Note: tiers
        outside stores] in tiering/stats.py); default: every group's master and gradient."""
        return [t for sg in self.groups for t in (sg.master, sg.grad)]

    def host_step_timings(self) -> dict[str, float]:
        """Seconds per phase of the host step's worker (``host_<phase>_s``); default: none."""
        return {}

    def close(self) -> None:
        """Remove hooks and free buffers."""
