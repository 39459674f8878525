"""The ZeRO-3 parameter attributes that transformers and TRL read, answered from zeroio's
side tables.

[Note: ds_* attributes on parameters]
DeepSpeed stores 29 ``ds_*`` attributes on every partitioned ``nn.Parameter``;
zeroio stores nothing on parameters (zeroio/partition/stage3/registry.py).
Code written for DeepSpeed reads three of them:

- ``ds_numel`` (transformers' ``get_model_param_count``, so the Trainer logs
  the real parameter count, not the local shard's);
- ``ds_shape`` (the full shape of a partitioned parameter);
- ``ds_status`` (TRL gathers only parameters whose status is not AVAILABLE).

While the facade is active they are read-only properties of
``torch.nn.Parameter`` that look the parameter up in zeroio's registries
(``OWNERS`` after the engine is built, ``INIT_SHARDS`` after ``zero.Init``).
A parameter zeroio does not partition raises ``AttributeError``, so
``hasattr(p, "ds_numel")`` is False for it, exactly as for a parameter
DeepSpeed never touched. Nothing is written on any parameter.
"""

from __future__ import annotations

import enum
import math

import torch

from zeroio.partition.stage3 import registry


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for a partitioned parameter's state."""

    AVAILABLE = 1  # full data present
    NOT_AVAILABLE = 2  # only this rank's shard
    INFLIGHT = 3  # being gathered


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...] | None:
    """The unpartitioned shape of a parameter zeroio partitions, or None."""
    owner = registry.OWNERS.get(p)
    if owner is not None:
        gi, si = owner.plan.slot_of[id(p)]
        return tuple(owner.pgroups[gi].plan.slots[si].shape)
    rec = registry.INIT_SHARDS.get(p)
    return tuple(rec.shape) if rec is not None else None


def _shape_or_raise(p, name: str) -> tuple[int, ...]:
    shape = full_shape(p)
    if shape is None:
        raise AttributeError(f"'Parameter' object has no attribute '{name}'")
    return shape


def _ds_shape(self):
    return torch.Size(_shape_or_raise(self, "ds_shape"))


def _ds_numel(self):
    return math.prod(_shape_or_raise(self, "ds_numel"))


def _ds_status(self):
    shape = _shape_or_raise(self, "ds_status")
    full = tuple(self.shape) == shape and self.numel() == math.prod(shape)
    return ZeroParamStatus.AVAILABLE if full else ZeroParamStatus.NOT_AVAILABLE


_PROPERTIES = {"ds_shape": _ds_shape, "ds_numel": _ds_numel, "ds_status": _ds_status}


def install() -> None:
    """Add the read-only ``ds_*`` properties to ``torch.nn.Parameter`` (idempotent)."""
    for name, getter in _PROPERTIES.items():
        if not isinstance(getattr(torch.nn.Parameter, name, None), property):
            setattr(torch.nn.Parameter, name, property(getter))
