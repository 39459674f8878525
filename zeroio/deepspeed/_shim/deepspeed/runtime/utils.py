"""``deepspeed.runtime.utils``."""

from zeroio.deepspeed.ranks import move_to_device

__all__ = ["move_to_device"]
