"""``deepspeed.utils``: ``logger``, ``log_dist``, the full-parameter accessors
(``safe_get_full_fp32_param``, ...), ``zero_to_fp32``, ``groups``, ``set_z3_leaf_modules``."""

from deepspeed.utils import groups, logging, tensor_fragment, zero_to_fp32
from deepspeed.utils.logging import log_dist, logger
from deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from zeroio.deepspeed.ranks import is_initialized, set_z3_leaf_modules

__all__ = ["logger", "log_dist", "logging", "groups", "zero_to_fp32", "tensor_fragment",
           "set_z3_leaf_modules", "is_initialized", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_optimizer_state"]
