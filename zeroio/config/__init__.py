"""DeepSpeed-compatible config: ``load_config(path_or_dict, **auto_values) -> Config``.

See docs/config.md for every key, its default and meaning, and docs/internals.md
for the attribute names other layers rely on. Importing this package does not
import torch.
"""

from zeroio.config.legacy import ConfigWarning
from zeroio.config.loader import Config, load_config, load_init_config
from zeroio.config.optim import OptimizerConfig, SchedulerConfig
from zeroio.config.sections import (
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    TagValidation,
)
from zeroio.config.zero import (
    EvictionPolicy,
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    TieringConfig,
    ZeroConfig,
)

__all__ = [
    "load_config",
    "load_init_config",
    "Config",
    "ConfigWarning",
    "ZeroConfig",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "TieringConfig",
    "EvictionPolicy",
    "AioConfig",
    "FP16Config",
    "BF16Config",
    "CheckpointConfig",
    "TagValidation",
    "OptimizerConfig",
    "SchedulerConfig",
]
