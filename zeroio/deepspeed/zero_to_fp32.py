"""``deepspeed.utils.zero_to_fp32`` on zeroio: the full fp32 weights of a ZeRO checkpoint.

DeepSpeed's three functions, with its signatures (``deepspeed/utils/zero_to_fp32.py``), read
the checkpoint folder ``save_checkpoint`` wrote (``latest`` names the tag when none is given)
through ``zeroio.checkpoint.consolidate``: no engine, any world size or stage that wrote it.

- ``get_fp32_state_dict_from_zero_checkpoint`` returns ``{name: fp32 tensor}`` on the CPU, in
  model order (``lazy_mode`` is accepted: the tensors are read at once);
- ``convert_zero_checkpoint_to_fp32_state_dict`` writes ``output_dir`` as safetensors
  (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with their index past
  ``max_shard_size``). zeroio writes no pickle, so ``safe_serialization=False``
  (DeepSpeed's ``pytorch_model.bin``) writes the same safetensors files, with a warning;
  transformers' ``from_pretrained`` reads either;
- ``load_state_dict_from_zero_checkpoint`` loads them into ``model`` (moved to the CPU,
  ``strict=False``, as DeepSpeed) and returns it.

``exclude_frozen_parameters`` leaves out what the checkpoint recorded as frozen (trained by
no optimizer group).
"""

from __future__ import annotations

import re

import torch

from zeroio.checkpoint import consolidate, resolve_tag, write_folder, write_safetensors
from zeroio.deepspeed.logs import logger
from zeroio.errors import ConfigError

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``max_shard_size`` as bytes: an integer, or "5GB" / "500MiB" (Hugging Face's units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*", str(size))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"max_shard_size = {size!r}: expected bytes as an integer or a size "
                          'such as "5GB" or "500MiB"', key="max_shard_size")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _frozen(checkpoint_dir, tag) -> list[str]:
    return list(resolve_tag(checkpoint_dir, tag, warn=False).scalars.get("frozen") or [])


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    out = consolidate(checkpoint_dir, tag, dtype=torch.float32)
    if exclude_frozen_parameters:
        for name in _frozen(checkpoint_dir, tag):
            out.pop(name, None)
    return out


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False):
    """Write the fp32 weights of ``checkpoint_dir`` into ``output_dir`` (see the module doc);
    returns the files written."""
    shard_bytes = parse_size(max_shard_size)
    if not safe_serialization:
        logger.warning("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False): "
                       "zeroio writes no pickle; %s gets model.safetensors instead of "
                       "pytorch_model.bin (from_pretrained reads either)", output_dir)
    frozen = _frozen(checkpoint_dir, tag) if exclude_frozen_parameters else []
    if not frozen:  # streamed, chunk by chunk: no copy of the model in memory
        return write_safetensors(checkpoint_dir, output_dir, tag, dtype=torch.float32,
                                 max_shard_bytes=shard_bytes, progress=False)
    tensors = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                       exclude_frozen_parameters=True)
    hf_config = resolve_tag(checkpoint_dir, tag, warn=False).meta.get("hf_config")
    return write_folder(tensors, output_dir, hf_config=hf_config, max_shard_bytes=shard_bytes)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None):
    """``model`` on the CPU with the checkpoint's fp32 weights loaded (``strict=False``)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
