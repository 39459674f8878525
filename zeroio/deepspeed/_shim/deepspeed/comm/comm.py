"""``deepspeed.comm.comm``: DeepSpeed's collectives and getters on zeroio's collectives."""

from zeroio.deepspeed.comm_api import *  # noqa: F403
from zeroio.deepspeed.comm_api import __all__ as _names
from zeroio.deepspeed.facade import init_distributed

__all__ = [*_names, "init_distributed"]
