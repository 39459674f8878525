"""``deepspeed.runtime.zero.partition_parameters``: the names transformers and TRL import.

zeroio's ``zero.Init`` does not wrap torch's tensor constructors, so the wrapper
transformers swaps around RoPE buffers (``zero_wrapper_for_fp_tensor_constructor``)
returns the constructor unchanged.
"""

import torch

from zeroio.deepspeed.facade import GatheredParameters, Init, register_external_parameter
from zeroio.deepspeed.params import ZeroParamStatus
from zeroio.deepspeed.ranks import get_accelerator

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, *args, **kwargs):
    return fn


__all__ = ["Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus",
           "get_accelerator", "zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange"]
