"""DeepSpeed's top-level functions on zeroio: ``initialize``, ``add_config_arguments``,
``init_distributed``."""

from __future__ import annotations

from zeroio.engine import init_distributed as _init_world
from zeroio.engine import initialize as _initialize

__all__ = ["initialize", "add_config_arguments", "init_distributed"]


def initialize(*args, **kwargs):
    """DeepSpeed's ``initialize``: ``(engine, optimizer, dataloader, lr_scheduler)``."""
    return _initialize(*args, **kwargs)


def add_config_arguments(parser):
    """DeepSpeed's ``--deepspeed`` / ``--deepspeed_config`` arguments on an argparse parser."""
    raise NotImplementedError("add_config_arguments")


def init_distributed(*args, **kwargs) -> None:
    """DeepSpeed's ``init_distributed``: join the launcher's world."""
    _init_world()
