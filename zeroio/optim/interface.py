"""What the engine asks of every optimizer it builds (``ShardedAdam``, ``SwappedAdam``,
``TwinAdam``) beyond ``step`` and ``param_groups``, with the defaults an optimizer that lacks
a capability inherits, so the engine never probes with getattr/hasattr."""

from __future__ import annotations

import torch


class EngineOptimizer:
    """The engine-facing surface of a zeroio optimizer."""

    store: object | None = None
    """The tiered store holding this optimizer's state (NVMe moments), whose counters
    ``engine.stats()`` reports; None where the state is plain tensors (``held_tensors``)."""
    chunked_step: bool = False
    """Whether ``begin_chunked_step`` is available (host masters stepped chunk by chunk by
    the partitioner's ``run_step``)."""

    def begin_chunked_step(self, grad_scale: float = 1.0):
        """A ``ChunkedStep`` (optim/adam.py) for the partitioner to run (``chunked_step``)."""
        raise NotImplementedError(f"{type(self).__name__} has no chunked step")

    def held_tensors(self) -> list[torch.Tensor]:
        """State kept in memory outside any tiered store ([Note: tiers outside stores] in
        tiering/stats.py); default: none."""
        return []

    def close(self) -> None:
        """Release stores and files; default: nothing to release."""


__all__ = ["EngineOptimizer"]
