"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion``, stepped by zeroio's Lion."""

from zeroio.deepspeed.optimizers import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
