"""``deepspeed.runtime``: ``engine``, ``lr_schedules``, ``zero``, ``utils``."""

from deepspeed.runtime import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]
