"""``deepspeed.DeepSpeedConfig`` (``deepspeed.runtime.config``) on zeroio.

DeepSpeed's class reads a config (path or dict) for the current world
(``mpu.get_data_parallel_world_size()`` when given, else the process group's size, else 1),
completes the batch keys and exposes the values as attributes. zeroio's does the same
through ``zeroio.load_config``, so every check of zeroio's config layer applies: an unknown
key, a wrong type or batch keys that do not multiply out is a ``ConfigError`` naming the key
(``DeepSpeedConfigError`` is that class). The attributes scripts read carry DeepSpeed's
names; ``zero_config`` is zeroio's ``zero_optimization`` block, whose fields have DeepSpeed's
names (``stage``, ``offload_optimizer.device``, ``reduce_bucket_size``, ...), and
``zeroio_config`` the whole resolved ``Config``.
"""

from __future__ import annotations

import copy
import json

from zeroio.config import load_config
from zeroio.config.loader import read_config
from zeroio.deepspeed.ds_config import for_zeroio
from zeroio.deepspeed.logs import logger
from zeroio.deepspeed.ranks import get_rank, get_world_size
from zeroio.errors import ConfigError

DeepSpeedConfigError = ConfigError
"""DeepSpeed's config error class: zeroio's ``ConfigError`` (a ``ValueError``)."""

_LOWERED_OPTIMIZERS = ("adam", "adamw", "lamb", "lion", "adagrad", "sgd", "onebitadam",
                       "onebitlamb", "zerooneadam", "muadam")


class DeepSpeedConfig:
    """A DeepSpeed config read for this world (see the module docstring)."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mesh_device is not None:
            raise ConfigError("DeepSpeedConfig(mesh_device=...) is a device mesh for model or "
                              "sequence parallelism, which zeroio does not implement",
                              key="mesh_device")
        self._param_dict = read_config(config)
        self.global_rank = get_rank()
        self.world_size = (mpu.get_data_parallel_world_size() if mpu is not None
                           else get_world_size())
        self.zeroio_config = load_config(for_zeroio(self._param_dict), world_size=self.world_size)
        self._set_attributes(self.zeroio_config)

    def _set_attributes(self, cfg) -> None:
        zero = cfg.zero_optimization
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.gradient_clipping = cfg.gradient_clipping
        self.steps_per_print = cfg.steps_per_print
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.zero_config = zero
        self.zero_optimization_stage = zero.stage
        self.zero_enabled = zero.stage > 0
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.loss_scale = cfg.fp16.loss_scale
        self.initial_dynamic_scale = 2 ** cfg.fp16.initial_scale_power
        self.aio_config = cfg.aio
        opt, sched = cfg.optimizer, cfg.scheduler
        name = opt.type if opt is not None else None
        self.optimizer_name = name.lower() if name and name.lower() in _LOWERED_OPTIMIZERS \
            else name
        self.optimizer_params = dict(opt.params) if opt is not None else None
        self.scheduler_name = sched.type if sched is not None else None
        self.scheduler_params = dict(sched.params) if sched is not None else None

    def print_user_config(self) -> None:
        logger.info("  json = {}".format(json.dumps(self._param_dict, sort_keys=True, indent=4,
                                                     default=str)))

    def print(self, name: str) -> None:
        """Every attribute at INFO, then the config as given (DeepSpeed's ``print``)."""
        logger.info(f"{name}:")
        for arg in sorted(vars(self)):
            if arg not in ("_param_dict", "zeroio_config"):
                logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(self, arg)}")
        self.print_user_config()

    def to_dict(self) -> dict:
        return copy.deepcopy(self._param_dict)
