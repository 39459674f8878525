"""``deepspeed.comm`` / ``deepspeed.accelerator`` / ``deepspeed.utils`` helpers on zeroio:
ranks and device names (through zeroio's collectives module and launch environment)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroio.config.launch_env import launch_env
from zeroio.partition import collectives as comm


def is_initialized() -> bool:
    return comm.is_initialized()


def get_rank(group=None) -> int:
    return comm.rank(group) if comm.is_initialized() else 0


def get_world_size(group=None) -> int:
    return comm.world_size(group) if comm.is_initialized() else 1


def get_local_rank() -> int:
    return launch_env().local_rank


def barrier(group=None) -> None:
    if comm.is_initialized():
        comm.barrier(group)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes) -> list[torch.nn.Module]:
    """DeepSpeed gathers a "leaf" module's whole subtree at once (for mixture-of-experts
    blocks whose experts run data-dependently); zeroio's stage 3 gathers whatever a
    forward touches, so nothing needs marking. Returns the matching modules, as DeepSpeed."""
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    return [m for m in model.modules()
            if isinstance(m, classes) or type(m).__name__ in names]


class _Accelerator:
    """The part of DeepSpeed's accelerator object transformers and TRL call."""

    def _name(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index=None) -> str:
        name = self._name()
        return name if device_index is None or name == "cpu" else f"{name}:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(get_local_rank()) if self._name() == "cuda" else "cpu"

    def current_device(self):
        return get_local_rank() if self._name() == "cuda" else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name() == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name() == "cuda" else "gloo"

    def synchronize(self, device_index=None) -> None:
        if self._name() == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name() == "cuda":
            torch.cuda.empty_cache()


_ACCELERATOR = _Accelerator()


def get_accelerator() -> _Accelerator:
    return _ACCELERATOR


def move_to_device(item: Any, device, criterion_func: Callable[[Any], bool] = lambda x: True):
    """``item`` (tensors nested in lists, tuples and dicts) with the tensors on ``device``."""
    if isinstance(item, torch.Tensor):
        return item.to(device) if criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
