"""Partitioning of parameters, gradients and optimizer state over data-parallel ranks.

``base`` holds the contract (``Partitioner``, ``ShardGroup``); ``stage12``
the stage 0/1/2 partitioner; ``stage3`` the stage 3 one.
"""

from zeroio.partition.base import ParamIndex, Partitioner, Segment, ShardGroup

__all__ = ["ParamIndex", "Partitioner", "Segment", "ShardGroup"]
