"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``)
on torch's activation checkpointing.

``checkpoint(function, *args)`` runs ``function`` without keeping its activations and runs it
again in backward (``torch.utils.checkpoint.checkpoint``, non-reentrant, the RNG state
restored so dropout repeats; at ZeRO stage 3 the recomputation gathers its parameters as
the forward did). ``configure`` takes DeepSpeed's arguments (or the config's
``activation_checkpointing`` block through ``deepspeed_config``):

- ``checkpoint_in_cpu``: the tensors a checkpointed region saves for backward are kept in
  host memory (``torch.autograd.graph.save_on_cpu``, pinned with CUDA) instead of the GPU;
- ``partition_activations``, ``contiguous_checkpointing``, ``num_checkpoints``: DeepSpeed
  splits saved activations over model-parallel ranks and packs them in one buffer; zeroio
  has no model parallelism, so there is nothing to split, and torch's allocator places them;
  accepted, no effect;
- ``synchronize``: a device synchronize before and after each checkpointed call;
- ``profile``: each call's forward time logged at INFO on the ``DeepSpeed`` logger.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import torch
import torch.utils.checkpoint

from zeroio.config.loader import read_config
from zeroio.deepspeed.logs import logger
from zeroio.errors import ConfigError


@dataclass(kw_only=True)
class Settings:
    """What ``configure`` set (DeepSpeed's module globals)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    configured: bool = False


SETTINGS = Settings()

_CONFIG_KEYS = {"partition_activations": "partition_activations",
                "contiguous_memory_optimization": "contiguous_checkpointing",
                "number_checkpoints": "num_checkpoints", "cpu_checkpointing": "checkpoint_in_cpu",
                "synchronize_checkpoint_boundary": "synchronize", "profile": "profile"}


def _from_config(deepspeed_config) -> dict:
    block = read_config(deepspeed_config).get("activation_checkpointing") or {}
    unknown = sorted(set(block) - set(_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"activation_checkpointing.{unknown[0]}: not one of DeepSpeed's keys "
                          f"({', '.join(_CONFIG_KEYS)})", key=f"activation_checkpointing.{unknown[0]}")
    return {_CONFIG_KEYS[k]: v for k, v in block.items() if v is not None}


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    """DeepSpeed's ``configure``: defaults, then the config's block, then the arguments given."""
    given = _from_config(deepspeed_config) if deepspeed_config is not None else {}
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("num_checkpoints", num_checkpoints),
                        ("checkpoint_in_cpu", checkpoint_in_cpu), ("synchronize", synchronize),
                        ("profile", profile)):
        if value is not None:
            given[name] = value
    fresh = Settings(configured=True)
    for f in fields(Settings):
        if f.name in given:
            setattr(fresh, f.name, given[f.name])
    for f in fields(Settings):
        setattr(SETTINGS, f.name, getattr(fresh, f.name))


def is_configured() -> bool:
    return SETTINGS.configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; zeroio keeps none."""


def _sync() -> None:
    if SETTINGS.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint(function, *args):
    """``function(*args)`` with its activations recomputed in backward (module docstring)."""
    saving = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
              if SETTINGS.checkpoint_in_cpu else contextlib.nullcontext())
    _sync()
    t0 = time.perf_counter()
    with saving:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    _sync()
    if SETTINGS.profile:
        logger.info(f"checkpointed forward of {getattr(function, '__name__', function)}: "
                    f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
    return out


non_reentrant_checkpoint = checkpoint

__all__ = ["configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint"]
