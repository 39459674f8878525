"""``deepspeed.ops``: the optimizer classes (``adam``, ``lamb``, ``lion``, ``adagrad``), run by
zeroio's sharded optimizers."""

from deepspeed.ops import adagrad, adam, lamb, lion

__all__ = ["adam", "lamb", "lion", "adagrad"]
