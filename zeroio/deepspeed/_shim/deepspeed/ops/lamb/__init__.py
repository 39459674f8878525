"""``deepspeed.ops.lamb``: ``FusedLamb``, stepped by zeroio's sharded Lamb."""

from zeroio.deepspeed.optimizers import FusedLamb

__all__ = ["FusedLamb"]
