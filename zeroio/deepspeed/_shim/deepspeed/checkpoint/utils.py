"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from zeroio.deepspeed.state_dict import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
