"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad``, stepped by zeroio's Adagrad."""

from zeroio.deepspeed.optimizers import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
