"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam``, run by zeroio's sharded Adam."""

from zeroio.deepspeed.optimizers import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
