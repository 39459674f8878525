"""The contract between the engine and a partitioner (stage 0/1/2 or stage 3).

The engine drives a partitioner through ``Partitioner`` and steps the
``ShardGroup``s it exposes; it never looks at how parameters or gradients are
split. The checkpoint layer reads and writes the same ``ShardGroup``s through
their ``segments`` map. The shard types (``ShardGroup``, ``Segment``, ``ParamIndex``,
[Note: global flat order], [Note: local layout]) live in zeroio/shard/types.py, below
both ``partition`` and ``optim``; they are re-exported here.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from zeroio.shard.types import ParamEntry, ParamIndex, Segment, ShardGroup  # noqa: F401 (re-exported)
from zeroio.tiering.gpu_tier import GpuTier
from zeroio.tiering.stats import TierStats

if TYPE_CHECKING:
    from zeroio.partition.stage3.twin import OptimizerSplit
    from zeroio.shard.assist import StepAssist


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
    transfers: TierStats | None = None
    """Its host <-> device copies' bytes (engine.stats()["bytes_moved"]); the optimizer built
    over it counts its own crossings (Lamb's norm sums, a twin's state reads) here too."""
    _assist: StepAssist | None = None
    """The step assist (shard/assist.py) of a partitioner whose host step runs on CUDA."""
    host_grad_divisor: float = 1.0
    """What the host optimizer divides gradients by on top of the loss scale (stage 1/2's
    16-bit host gradients are not averaged over ranks yet); 1.0: already averaged."""
    grad_read_dtype: torch.dtype | None = None
    """The dtype of the gradient its host step hands the CPU optimizer (the host shard's, or
    the gradient window's: [Note: the gradient window] in tiering/grad_window.py); None:
    the ShardGroups' own gradients'."""
    grads_streamed: bool = False
    """The host optimizer's gradient stays on the device and the host step reads it through
    a window ([Note: the gradient's home] in config/accum_place.py)."""
    group: object | None = None
    """The process group it partitions over (None: the default world)."""
    store: object | None = None
    """The partitioner's parameter store (stage 3), None where it keeps none."""
    runs_host_step: bool = False
    """Whether ``run_step`` can run the host optimizer step chunk by chunk."""
    stages_ranges: bool = False
    """Whether ``stage_range`` publishes updated ranges while the optimizer steps."""
    forward_rerunnable: bool = False
    """Whether a forward that failed (out of GPU memory) may simply be run again: no hook
    state of its own is left half done ([Note: resident state yields] in tiering/gpu_tier.py)."""

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

    def release_device_state(self) -> None:
        """Make the host optimizer state current before something other than the step reads
        or writes it (the optimizer's ``local_tensor``): the step finished, and state the step
        assist keeps on the GPU between steps back in host memory ([Note: resident chunks] in
        shard/assist.py)."""
        self.wait_step()
        if self._assist is not None:
            self._assist.release()

    def grads_to_host(self) -> None:
        """Make every ``ShardGroup.grad`` (each side's, with a ratio split) hold this step's
        gradient before something other than the step reads it (``deepspeed.utils.
        safe_get_full_grad``): gradients kept elsewhere are copied in. Default: they always
        are there."""

    def gpu_tier(self) -> GpuTier:
        """The GPU tier of the state kept on the GPU between steps (the step assist's resident
        chunks; an empty one without an assist), its evictions behind ``wait_step``
        ([Note: resident state yields] in tiering/gpu_tier.py)."""
        tier = self._assist.tier if self._assist is not None else GpuTier()
        tier.quiesce = self.wait_step
        for fixed in (getattr(self, "_accum", None),  # tiering/device_accum.py,
                      getattr(self, "_window", None)):  # tiering/grad_window.py: fixed state
            if fixed is not None and fixed not in tier.fixed:
                tier.register_fixed(fixed)
        return tier

    def stats_sources(self) -> dict[str, dict]:
        """Counter sources for ``engine.stats()`` (tiering/stats.py); default: none."""
        return {}

    def held_tensors(self) -> list[torch.Tensor]:
        """What this partitioner keeps in memory outside any tiered store ([Note: tiers
        outside stores] in tiering/stats.py); default: every group's master and gradient."""
        return [t for sg in self.groups for t in (sg.master, sg.grad)]

    def step_clock(self):
        """The host step's ``PhaseClock`` (step_overlap.py) behind ``engine.stats()
        ["breakdown"]``; default: None, no host step."""
        return None

    def host_step_timings(self) -> dict[str, float]:
        """Seconds per phase of the host step's worker (``host_<phase>_s``); default: none."""
        return {}

    def close(self) -> None:
        """Remove hooks and free buffers."""
