"""``deepspeed.runtime``: ``engine``, ``config``, ``base_optimizer``, ``lr_schedules``, ``zero``,
``utils``, ``activation_checkpointing``."""

from deepspeed.runtime import (
    activation_checkpointing,
    base_optimizer,
    config,
    engine,
    lr_schedules,
    utils,
    zero,
)

__all__ = ["engine", "config", "base_optimizer", "lr_schedules", "utils", "zero",
           "activation_checkpointing"]
