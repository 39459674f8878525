"""``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer`` and ``ZeROOptimizer``.

Clients test ``isinstance(opt, DeepSpeedOptimizer)`` to tell the optimizer an engine returned
from a plain torch one (Lightning Fabric's checkpointing does). DeepSpeed's ZeRO optimizers
derive from ``ZeROOptimizer``; zeroio's engine optimizers (every ``EngineOptimizer``:
``ShardedAdam``, ``SwappedAdam``, ``TwinAdam``, the rule optimizers) are registered as virtual
subclasses, so the test answers True for the optimizer ``deepspeed.initialize`` returns.
"""

from __future__ import annotations

import abc

from zeroio.optim.interface import EngineOptimizer


class DeepSpeedOptimizer(abc.ABC):  # noqa: B024 - a marker base, as DeepSpeed's
    """The base of DeepSpeed's optimizers (a marker class)."""


class ZeROOptimizer(DeepSpeedOptimizer):  # noqa: B024
    """The base of DeepSpeed's ZeRO optimizers; zeroio's engine optimizers are its virtual
    subclasses."""


ZeROOptimizer.register(EngineOptimizer)

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
