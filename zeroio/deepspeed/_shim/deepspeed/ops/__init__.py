"""``deepspeed.ops``: the optimizers accelerate maps torch's onto (``ops.adam``)."""

from deepspeed.ops import adam

__all__ = ["adam"]
