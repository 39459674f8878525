"""How an optimizer step is applied and its parameters published: chosen once, at initialize.

[Note: step protocols]
The engine's ``step`` computes the global norm, decides clipping and overflow, and then hands
the update to one of three protocols. Which one runs depends only on what was built (the
partitioner, the optimizer and ``offload_optimizer.device``), so ``choose_protocol`` decides
it when the engine is made and ``Engine.step`` never branches on flags:

- ``OverlappedHostStep``: host masters stepped chunk by chunk on the partitioner's worker,
  each chunk published behind its update (``run_step``; offload_optimizer cpu with a
  partitioner that ``runs_host_step`` and an optimizer with ``chunked_step``). It returns
  while the worker runs; ranks do not vote (the step's failure surfaces later as a
  ``HostStepError``: [Note: atomic step] in step_guard.py).
- ``RangePublish``: host masters stepped by a whole-step optimizer (the NVMe swapper, a rule
  without chunks), each updated range staged for publication as it completes
  (``stage_range``), then ``publish_params(staged=True)``.
- ``WholePublish``: the optimizer steps everything (device masters: offload none), then
  ``publish_params()``.

Both non-overlapped protocols let the ranks vote (``guard.agree``) between the update and the
publication, which is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Guard(Protocol):
    """What a protocol asks of the engine's ``StepGuard`` (step_guard.py)."""

    def updating(self, *, vote: bool) -> None: ...

    def agree(self) -> None: ...


@dataclass(frozen=True)
class OverlappedHostStep:
    name = "overlapped host step"
    overlapped = True

    def apply(self, optimizer: Any, partitioner: Any, guard: Guard, grad_scale: float) -> None:
        guard.updating(vote=False)
        # CPU Adam chunk by chunk on a worker, each chunk published behind it (a TwinAdam
        # steps its device side first: partition/stage3/twin.py)
        chunked = optimizer.begin_chunked_step(grad_scale=grad_scale)
        partitioner.run_step(chunked.update, out_in_pass=chunked.out_in_pass, step=chunked)


@dataclass(frozen=True)
class RangePublish:
    name = "host step, ranges published"
    overlapped = False

    def apply(self, optimizer: Any, partitioner: Any, guard: Guard, grad_scale: float) -> None:
        guard.updating(vote=True)
        optimizer.step(grad_scale=grad_scale, on_updated=partitioner.stage_range)
        guard.agree()
        partitioner.publish_params(staged=True)


@dataclass(frozen=True)
class WholePublish:
    name = "step, then publish"
    overlapped = False

    def apply(self, optimizer: Any, partitioner: Any, guard: Guard, grad_scale: float) -> None:
        guard.updating(vote=True)
        optimizer.step(grad_scale=grad_scale)
        guard.agree()
        partitioner.publish_params()


StepProtocol = OverlappedHostStep | RangePublish | WholePublish


def choose_protocol(partitioner: Any, optimizer: Any, offload_device: str) -> StepProtocol:
    """The protocol of an engine with this partitioner, optimizer and
    ``offload_optimizer.device`` ([Note: step protocols])."""
    if partitioner.runs_host_step and offload_device == "cpu" and optimizer.chunked_step:
        return OverlappedHostStep()
    if partitioner.stages_ranges and offload_device != "none":
        return RangePublish()
    return WholePublish()


__all__ = ["OverlappedHostStep", "RangePublish", "StepProtocol", "WholePublish",
           "choose_protocol"]
