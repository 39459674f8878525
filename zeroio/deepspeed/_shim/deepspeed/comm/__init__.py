"""``deepspeed.comm``: DeepSpeed's collectives (``all_reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter_tensor``, ...) and getters (``get_rank``, ``get_world_size``, ...) over
torch.distributed, through zeroio's collectives module."""

from deepspeed.comm import comm
from deepspeed.comm.comm import *  # noqa: F403
from deepspeed.comm.comm import __all__ as _names

__all__ = [*_names, "comm"]
