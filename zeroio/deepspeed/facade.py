"""The ``deepspeed`` facade: DeepSpeed's Python API served by zeroio in this process.

[Note: activating the facade]
transformers, accelerate and TRL decide that DeepSpeed is present when
``importlib.util.find_spec("deepspeed")`` finds a package *and*
``importlib.metadata.metadata("deepspeed")`` finds a distribution; accelerate
then also compares ``importlib.metadata.version("deepspeed")`` with its minimum
(0.9.3, and later versions for optional features). ``shim_dir()`` holds both: a
``deepspeed`` package whose modules forward here, and a
``deepspeed-<FOLLOWS>.dist-info`` with the version the facade follows. A folder
on ``sys.path`` answers both lookups, so activation is one of:

- ``zeroio launch`` puts ``shim_dir()`` first on the children's ``PYTHONPATH``
  (it wins over an installed DeepSpeed there: that is what the launcher is for);
- ``install()`` (run by ``import zeroio.deepspeed`` and
  ``import zeroio.integrations.transformers``) puts it first on ``sys.path`` of
  this process, unless a real DeepSpeed is installed, which is then left alone and
  named in a WARNING on rank 0 ([Note: a DeepSpeed installation beside the import line]
  in banner.py).

``import zeroio`` alone installs nothing. transformers picks the base class of
its ``HfDeepSpeedConfig`` when ``transformers.integrations.deepspeed`` is first
imported; a process that imported it before the facade was active gets the
module re-executed in place (``importlib.reload`` keeps its namespace, so
functions already imported elsewhere see the new classes).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from pathlib import Path

from zeroio.deepspeed import api, banner, cpu_backend, params
from zeroio.deepspeed import zero as _zero
from zeroio.deepspeed.ds_config import for_zeroio
from zeroio.deepspeed.engine_adapter import as_deepspeed_engine, scheduler_factory
from zeroio.errors import ConfigError
from zeroio.partition.zero import register_external_parameter

GatheredParameters = _zero.GatheredParameters

__all__ = ["install", "active", "initialize", "init_distributed", "Init", "GatheredParameters",
           "register_external_parameter", "install_parameter_attributes"]


def shim_dir() -> Path:
    return Path(__file__).resolve().parent / "_shim"


def _is_ours(path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(shim_dir())
    except (OSError, ValueError):
        return False


def active() -> bool:
    """Whether ``import deepspeed`` gives the facade in this process."""
    mod = sys.modules.get("deepspeed")
    if mod is not None:
        return _is_ours(getattr(mod, "__file__", "") or "")
    spec = importlib.util.find_spec("deepspeed")
    return spec is not None and _is_ours(spec.origin or "")


def _real_deepspeed() -> tuple[str | None, str]:
    """(version, where) of the DeepSpeed that ``import deepspeed`` gives in this process."""
    mod = sys.modules.get("deepspeed")
    if mod is not None:
        return getattr(mod, "__version__", None), str(getattr(mod, "__file__", "") or mod)
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None, "on the import path"
    return dist.version, str(dist.locate_file("deepspeed"))


_WARNED: list[bool] = []


def _warn_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        banner.warn_real_deepspeed(*_real_deepspeed())


def real_deepspeed_installed() -> bool:
    """A ``deepspeed`` distribution other than the facade's is importable."""
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False
    return not _is_ours(dist.locate_file(""))


def install() -> bool:
    """Make ``import deepspeed`` give the facade here (see [Note: activating the facade]).

    Returns whether the facade is active; a real DeepSpeed installation is left
    alone (False, with a log line naming ``zeroio launch``).
    """
    if active():
        import deepspeed  # noqa: F401  (its metadata is already found: nothing to patch)

        _refresh_transformers()
        return True
    if "deepspeed" in sys.modules or real_deepspeed_installed():
        _warn_once()  # [Note: a DeepSpeed installation beside the import line]
        return False
    sys.path.insert(0, str(shim_dir()))
    importlib.invalidate_caches()
    import deepspeed  # noqa: F401

    _refresh_transformers()
    return True


_ACCELERATE_DS_NAMES = ("DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
                        "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler",
                        "HfDeepSpeedConfig", "get_active_deepspeed_plugin",
                        "map_pytorch_optim_to_deepspeed")
"""What accelerate.utils (and accelerate.accelerator, transformers.trainer from it) import only
when DeepSpeed is importable at their own import time."""


def _refresh_transformers() -> None:
    cpu_backend.install()  # [Note: DeepSpeed under accelerate without a GPU]
    mod = sys.modules.get("transformers.integrations.deepspeed")
    if mod is not None and mod.HfDeepSpeedConfig.__mro__[1] is object:
        importlib.reload(mod)
    _refresh_accelerate()


def _refresh_accelerate() -> None:
    """Modules imported before the facade was on the path skipped their DeepSpeed imports
    (``if is_deepspeed_available(): from accelerate.utils import ...``); give them the names now,
    so a later ``transformers.trainer`` import or ``Accelerator`` finds them."""
    utils = sys.modules.get("accelerate.utils")
    if utils is None or hasattr(utils, "DeepSpeedSchedulerWrapper"):
        return
    source = importlib.import_module("accelerate.utils.deepspeed")
    for name in ("accelerate.utils", "accelerate.accelerator", "transformers.trainer"):
        target = sys.modules.get(name)
        for attr in _ACCELERATE_DS_NAMES if target is not None else ():
            if hasattr(source, attr) and not hasattr(target, attr):
                setattr(target, attr, getattr(source, attr))


def install_parameter_attributes() -> None:
    """``ds_numel`` / ``ds_shape`` / ``ds_status`` (see [Note: ds_* attributes on parameters])."""
    params.install()


# ---- the API the facade's modules forward to -----------------------------------------------

init_distributed = api.init_distributed  # DeepSpeed's signature, every argument honoured


def _config_dict(config, args) -> dict | str:
    if config is None and args is not None:  # --deepspeed is a flag; --deepspeed_config a file
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        flag = getattr(args, "deepspeed", None)
        if config is None and isinstance(flag, (str, dict, Path)):
            config = flag
    if config is None:
        raise ConfigError("deepspeed.initialize needs config= (or config_params=, or "
                          "args.deepspeed_config): a path or a dict", key="config")
    return for_zeroio(config) if isinstance(config, dict) else config


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's ``initialize`` on zeroio: ``(engine, optimizer, dataloader, lr_scheduler)``
    where ``engine`` is a ``DeepSpeedEngine`` (zeroio/deepspeed/engine_adapter.py)."""
    given = config if config is not None else config_params
    cfg = _config_dict(given, args)
    if isinstance(cfg, dict) and optimizer is None and "optimizer" not in cfg:
        # inference (transformers' evaluate-only deepspeed_init): DeepSpeed ignores a
        # scheduler without an optimizer; its "auto" step count is then 0
        cfg.pop("scheduler", None)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0}}  # zeroio's engine needs one
    if optimizer is None and callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        # transformers' lr_scheduler_type over the config's optimizer (a client optimizer is
        # what the callable gets: api._client_scheduler)
        lr_scheduler = scheduler_factory(lr_scheduler)
    # api.initialize reads args too (args.local_rank, a config given twice); a config read
    # from args is passed as args alone unless it had to be rewritten (a dict)
    from_args = given is None
    engine, opt, loader, sched = api.initialize(
        args=None if from_args and isinstance(cfg, dict) else args, model=model,
        optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, distributed_port=distributed_port or api.DEFAULT_PORT,
        mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn,
        config=None if from_args and not isinstance(cfg, dict) else cfg, mesh_param=mesh_param)
    shown = cfg if isinstance(cfg, dict) else _read_json(cfg)
    banner.announce(engine)  # [Note: the start-up banner]
    return as_deepspeed_engine(engine, shown), opt, loader, sched


def _read_json(path) -> dict:
    import copy

    from zeroio.config.loader import read_config

    return copy.deepcopy(read_config(path))  # a private copy: the callers edit it


def _init_config(config):
    """What ``zero.Init`` reads of a DeepSpeed config: all but the ``optimizer`` and
    ``scheduler`` blocks, whose "auto" values (``total_num_steps``) transformers fills only
    once the step count is known, after the model is built."""
    if config is None or not isinstance(config, (dict, str, Path)):
        return config
    raw = for_zeroio(config) if isinstance(config, dict) else _read_json(config)
    raw.pop("optimizer", None)
    raw.pop("scheduler", None)
    return raw


def _translated_init():
    target = _zero.Init
    takes_ds_keywords = "config_dict_or_path" in inspect.signature(target).parameters

    def Init(module=None, data_parallel_group=None, mem_efficient_linear=True,  # noqa: N802
             remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
             enabled=True, dtype=None, mpu=None, **more):
        """``deepspeed.zero.Init`` with DeepSpeed's keywords, on zeroio's ``zero.Init``."""
        given = _init_config(config if config is not None else config_dict_or_path)
        if takes_ds_keywords:
            return target(module=module, data_parallel_group=data_parallel_group,
                          remote_device=remote_device, pin_memory=pin_memory,
                          config_dict_or_path=given, enabled=enabled, dtype=dtype, mpu=mpu,
                          **more)
        if module is not None:
            raise ConfigError("deepspeed.zero.Init(module=...) (partitioning an existing "
                              "module) is not supported: build the model inside the context",
                              key="module")
        return target(config=given, dtype=dtype, enabled=enabled,
                      data_parallel_group=data_parallel_group)

    return Init


Init = _translated_init()
