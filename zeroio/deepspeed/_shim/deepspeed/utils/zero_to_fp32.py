"""``deepspeed.utils.zero_to_fp32``: fp32 weights of a ZeRO checkpoint, through
``zeroio.checkpoint.consolidate``."""

from zeroio.deepspeed.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
