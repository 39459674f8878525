"""``deepspeed.comm``: rank, world size and start-up of the process group, on zeroio."""

from zeroio.deepspeed.facade import init_distributed
from zeroio.deepspeed.ranks import barrier, get_local_rank, get_rank, get_world_size, is_initialized

__all__ = ["init_distributed", "get_rank", "get_world_size", "get_local_rank", "is_initialized",
           "barrier"]
