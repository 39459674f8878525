"""zeroio: ZeRO data-parallel training whose state lives in GPU, pinned CPU and NVMe tiers.

Public API (DESIGN.md): ``initialize``, ``load_config``, ``Config``,
``estimate_memory``, ``zero.Init``, ``zero.GatheredParameters``,
``checkpoint.consolidate`` and the error types. Heavy submodules are imported
lazily so ``import zeroio`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

from zeroio.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DistributedError,
    IntegrityError,
    RankFailedError,
    StepFailedError,
    SwapIOError,
    ZeroIOError,
)

__version__ = "0.1.0"

_LAZY = {
    "initialize": ("zeroio.engine", "initialize"),
    "Engine": ("zeroio.engine", "Engine"),
    "load_config": ("zeroio.config", "load_config"),
    "Config": ("zeroio.config", "Config"),
    "estimate_memory": ("zeroio.estimate", "estimate_memory"),
    "zero": ("zeroio.partition.zero", None),
    "checkpoint": ("zeroio.checkpoint", None),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'zeroio' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


__all__ = [
    "__version__",
    "initialize",
    "Engine",
    "load_config",
    "Config",
    "estimate_memory",
    "zero",
    "checkpoint",
    "ZeroIOError",
    "ConfigError",
    "SwapIOError",
    "StepFailedError",
    "IntegrityError",
    "CapacityError",
    "CheckpointError",
    "DistributedError",
    "RankFailedError",
]
