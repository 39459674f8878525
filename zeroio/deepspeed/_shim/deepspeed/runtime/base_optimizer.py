"""``deepspeed.runtime.base_optimizer``: zeroio's engine optimizers are ``ZeROOptimizer``s."""

from zeroio.deepspeed.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
