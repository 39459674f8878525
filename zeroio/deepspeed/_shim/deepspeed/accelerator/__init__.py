"""``deepspeed.accelerator``: ``get_accelerator()`` (the device names transformers asks for)."""

from zeroio.deepspeed.ranks import get_accelerator

__all__ = ["get_accelerator"]
