"""ZeRO stage 3: parameters partitioned over ranks and gathered per module group on use.

Read in this order: state (enums), settings, layout (grouping and flat
layout), store (where shards live), group (one flat group), prefetch (trace),
hooks, partitioner (the ``Partitioner`` protocol), init (``zero.Init``).
"""

from zeroio.partition.stage3.partitioner import Stage3Partitioner, build_stage3_partitioner
from zeroio.partition.stage3.settings import Stage3Settings

__all__ = ["Stage3Partitioner", "Stage3Settings", "build_stage3_partitioner"]
