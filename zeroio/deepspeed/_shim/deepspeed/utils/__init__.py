"""``deepspeed.utils``: ``logger``, ``groups``, ``set_z3_leaf_modules``, ``is_initialized``."""

import logging

from deepspeed.utils import groups
from zeroio.deepspeed.ranks import is_initialized, set_z3_leaf_modules

logger = logging.getLogger("DeepSpeed")

__all__ = ["logger", "groups", "set_z3_leaf_modules", "is_initialized"]
