"""``deepspeed.utils.groups``: the data-parallel group is the whole world on zeroio."""

from zeroio.deepspeed.ranks import get_rank as _get_data_parallel_rank
from zeroio.deepspeed.ranks import get_world_size as _get_data_parallel_world_size

__all__ = ["_get_data_parallel_rank", "_get_data_parallel_world_size"]
