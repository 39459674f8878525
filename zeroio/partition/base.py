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
from typing import Protocol, runtime_checkable

import torch

from zeroio.shard.types import ParamEntry, ParamIndex, Segment, ShardGroup  # noqa: F401 (re-exported)


class Phase(enum.Enum):
    """Where a partitioner is in the accumulation cycle."""

    IDLE = "idle"                  # gradients zero, nothing in flight
    ACCUMULATING = "accumulating"  # inside a micro step's backward, reductions may be in flight
    REDUCED = "reduced"            # boundary reached; ShardGroup.grad final for this step
    STEPPED = "stepped"            # masters updated; params not yet published


@runtime_checkable
class Partitioner(Protocol):
    """What the engine calls, in this order, each optimizer step:

    for each micro step:  ``begin_micro_step(boundary)`` -> user forward ->
        ``loss.backward()`` (hooks reduce buckets as they fill) ->
        ``finalize_gradients(boundary)``
    at the boundary:  ``local_grad_sq_norm()`` / ``local_overflow()`` ->
        optimizer steps ``groups`` (or skips) -> ``publish_params()`` (only
        when stepped) -> ``zero_grad()``.
    """

    stage: int
    groups: list[ShardGroup]
    index: ParamIndex

    def begin_micro_step(self, boundary: bool) -> None:
        """Arm hooks for one backward; ``boundary`` says whether it ends the accumulation."""

    def finalize_gradients(self, boundary: bool) -> None:
        """After a backward: launch any unfired bucket, wait for reductions, and at the boundary
        leave every ``ShardGroup.grad`` final (averaged over world and accumulation)."""

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp32 scalar tensor on the comm device).
        The engine all-reduces it for the global norm; shards are disjoint so nothing double counts."""

    def local_overflow(self) -> bool:
        """Whether any of this rank's gradient shards holds inf/nan (fp16 loss scaling)."""

    def publish_params(self) -> None:
        """Copy updated masters into the model's compute parameters on every rank."""

    def zero_grad(self) -> None:
        """Clear gradients (local shards and any model .grad) for the next accumulation."""

    def close(self) -> None:
        """Remove hooks and free buffers."""
