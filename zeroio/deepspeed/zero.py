"""``deepspeed.zero`` on zeroio: ``Init`` with DeepSpeed's keyword arguments,
``GatheredParameters`` and ``register_external_parameter``.

``Init`` is ``zeroio.zero.Init`` (zeroio/partition/zero.py) under DeepSpeed's
signature (``deepspeed/runtime/zero/partition_parameters.py``). How each
argument maps (docs/deepspeed.md has the table):

- ``config_dict_or_path`` (or the deprecated ``config``): the config zero.Init
  reads (only what partitioning needs: ``load_init_config``);
- ``dtype``: the dtype the shards keep; without it the config's fp16/bf16 switch,
  else the model's own dtype (DeepSpeed, with neither, converts to fp16);
- ``enabled=False``: a no-op context, the config not read;
- ``data_parallel_group`` (or ``mpu.get_data_parallel_group()``, or the deprecated
  ``sequence_data_parallel_group``): the ranks the parameters are split over;
- ``module``: an already-built model, partitioned now as if built inside;
- ``remote_device``: where the shards live until ``initialize``. zeroio keeps
  them in host memory whatever it says ("cpu" is exactly that); the config's
  ``offload_param.device`` decides their home in training and, as in DeepSpeed,
  wins over the argument. "nvme" needs that block with an ``nvme_path``, as in
  DeepSpeed;
- ``pin_memory``: recorded; pinning of training state follows the engine's
  placement (the ``tiering`` budgets);
- ``mem_efficient_linear``: no effect (zeroio replaces no torch function).

Hierarchical partitioning (``zero_param_parallel_group``), quantized weights
and a ``param_swapper`` are not implemented: a value other than DeepSpeed's
default is a ConfigError.
"""

from __future__ import annotations

from zeroio.deepspeed.api import init_distributed
from zeroio.errors import ConfigError
from zeroio.partition.zero import GatheredParameters, register_external_parameter
from zeroio.partition.zero import Init as _ZeroioInit

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]

_REMOTE_DEVICES = ("none", "cpu", "nvme")


def _group(data_parallel_group, sequence_data_parallel_group, mpu):
    if sequence_data_parallel_group is not None:
        if data_parallel_group is not None:
            raise ConfigError("zero.Init: both data_parallel_group and "
                              "sequence_data_parallel_group are given; pass one",
                              key="data_parallel_group")
        return sequence_data_parallel_group
    if data_parallel_group is None and mpu is not None:
        return mpu.get_data_parallel_group()
    return data_parallel_group


def _remote_device(remote_device, config) -> str:
    """The device the shards would live on in DeepSpeed: the config's
    ``offload_param.device`` when it sets one, else ``remote_device``."""
    name = "none" if remote_device is None else str(getattr(remote_device, "value",
                                                            remote_device)).lower()
    if name not in _REMOTE_DEVICES:
        raise ConfigError(f"zero.Init(remote_device={remote_device!r}): expected one of "
                          f"{', '.join(_REMOTE_DEVICES)} (or None)", key="remote_device")
    offload = config.zero_optimization.offload_param if config is not None else None
    if offload is not None and offload.device.value != "none":
        return offload.device.value
    if name == "nvme":
        raise ConfigError(
            "zero.Init(remote_device='nvme') needs config_dict_or_path with "
            'zero_optimization.offload_param {"device": "nvme", "nvme_path": ...}: the '
            "parameters' NVMe home is that block's", key="zero_optimization.offload_param")
    return name


def _unsupported(**given) -> None:
    for name, value in given.items():
        if value not in (None, False):
            raise ConfigError(f"zero.Init({name}={value!r}) is not implemented by zeroio; leave "
                              "it at DeepSpeed's default", key=name)


class Init(_ZeroioInit):
    """DeepSpeed's ``zero.Init``: modules built inside have their parameters partitioned
    over the data-parallel ranks (see the module docstring for each argument)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None, tensor_overrides=None):
        _unsupported(zero_param_parallel_group=zero_param_parallel_group,
                     zero_quantized_weights=zero_quantized_weights,
                     zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                     param_swapper=param_swapper)
        if config is not None and config_dict_or_path is not None:
            raise ConfigError("zero.Init got both config_dict_or_path and config (its deprecated "
                              "spelling): pass config_dict_or_path", key="config")
        source = config_dict_or_path if config_dict_or_path is not None else config
        init_distributed()  # DeepSpeed's Init joins the world itself
        group = _group(data_parallel_group, sequence_data_parallel_group, mpu)
        super().__init__(config=source, dtype=dtype, enabled=enabled, data_parallel_group=group)
        self.remote_device = _remote_device(remote_device, self.config) if enabled else "none"
        """Where DeepSpeed would keep the shards ("none": the GPU); zeroio keeps them in host
        memory until ``initialize`` places them by the config."""
        self.pin_memory = bool(pin_memory) and self.remote_device in ("cpu", "nvme")
        self.mem_efficient_linear = mem_efficient_linear
        self.module = module
        if module is not None and enabled:
            self.partition_module(module)

    def partition_module(self, module) -> None:
        """Partition an already-built ``module``'s parameters now, as if it had been built
        inside the context (DeepSpeed's ``Init(module=...)``)."""
        self._pending.extend(m for m in module.modules() if m not in self._pending)
        self.flush()
