"""``deepspeed.runtime.utils``: ``move_to_device``, ``see_memory_usage``."""

from zeroio.deepspeed.logs import see_memory_usage
from zeroio.deepspeed.ranks import move_to_device

__all__ = ["move_to_device", "see_memory_usage"]
