"""DeepSpeed's top-level functions on zeroio: ``initialize``, ``add_config_arguments``,
``init_distributed``.

Signatures and meanings are DeepSpeed's (0.16-0.18; ``deepspeed/__init__.py`` and
``deepspeed/comm/comm.py``); docs/deepspeed.md lists what differs and what is
not covered. The config passed in (``config=``, ``config_params=`` or
``args.deepspeed_config``) is read by ``zeroio.config.script.load_script_config``:
a config written for the Hugging Face Trainer runs from a plain script, its
"auto" values filled where the run determines them.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from zeroio.config.accelerate_launch import fewer_than_asked
from zeroio.config.launch_env import launch_env
from zeroio.config.legacy import ConfigWarning
from zeroio.config.loader import collective_timeout
from zeroio.config.script import load_script_config
from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm

__all__ = ["initialize", "add_config_arguments", "init_distributed"]

DEFAULT_PORT = 29500
"""DeepSpeed's ``TORCH_DISTRIBUTED_DEFAULT_PORT``."""
DEFAULT_TIMEOUT = timedelta(minutes=30)
"""DeepSpeed's ``default_pg_timeout``."""
_BACKENDS = ("nccl", "gloo")


def add_config_arguments(parser):
    """DeepSpeed's argument group on an argparse parser (``--deepspeed``,
    ``--deepspeed_config``, and the deprecated ``--deepscale``, ``--deepscale_config``);
    returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script itself; zeroio ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser


def _backend(dist_backend: str | None) -> str:
    cuda = torch.cuda.is_available()
    if dist_backend is None:
        return "nccl" if cuda else "gloo"
    name = str(dist_backend).lower()
    if name not in _BACKENDS:
        raise ConfigError(f"init_distributed(dist_backend={dist_backend!r}): zeroio runs on "
                          f"{' or '.join(_BACKENDS)}", key="dist_backend")
    if name == "nccl" and not cuda:  # a script written for GPUs, run on a CPU machine
        warnings.warn(ConfigWarning("init_distributed(dist_backend='nccl'): no CUDA on this "
                                    "machine, joining with gloo instead"), stacklevel=3)
        return "gloo"
    return name


def _seconds(timeout) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    raise ConfigError(f"init_distributed(timeout={timeout!r}): expected a datetime.timedelta",
                      key="timeout")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout=DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the launcher's world (nccl with CUDA, gloo without), as DeepSpeed's.

    Already joined: nothing. Started by ``zeroio launch``, ``torchrun`` or
    ``deepspeed``'s launcher: the world they describe (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, or ``init_method`` with ``rank`` and
    ``world_size``). A bare process becomes a world of one (DeepSpeed would try
    MPI discovery; zeroio does not, ``auto_mpi_discovery`` and ``distributed_port``
    are accepted for their signature). ``config`` (DeepSpeed's comms settings) is
    not read."""
    _check_accelerate_count()
    if comm.is_initialized():
        return
    if dist_init_required is False:
        raise ConfigError("init_distributed(dist_init_required=False) but no process group "
                          "exists: initialise torch.distributed first, or leave it None",
                          key="dist_init_required")
    backend = _backend(dist_backend)
    seconds = _seconds(timeout)
    env = launch_env()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    kwargs: dict[str, Any] = {}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    if env.launched or kwargs:
        comm.init_world(backend, seconds, **kwargs)
    else:
        comm.init_local_world(seconds)


def _check_accelerate_count() -> None:
    """``accelerate launch --num_processes N`` with no config starts one process ([Note: the
    process count accelerate was asked for] in zeroio/config/accelerate_launch.py): refuse to
    train that one rank as if it were the world."""
    mismatch = fewer_than_asked()
    if mismatch is None:
        return
    asked, started = mismatch
    what = "more than one process" if asked == 0 else f"{asked} processes"
    n = asked or "N"
    raise ConfigError(
        f"accelerate launch was asked for {what} but started {started}: without a config whose "
        "distributed_type starts several processes (or --multi_gpu) accelerate runs one process. "
        f"Run `zeroio launch --nproc {n} SCRIPT ...`, or `zeroio launch --config_file CFG.yaml "
        "SCRIPT ...` with an accelerate config (distributed_type: DEEPSPEED, num_processes: "
        f"{n}): docs/transformers.md, \"accelerate\"", key="num_processes")


def _args_config(args) -> Any:
    """The config named on the command line: ``args.deepspeed_config``, or the deprecated
    ``args.deepscale_config`` (both set is an error, as in DeepSpeed)."""
    ds = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None and ds is not None:
        raise ConfigError(f"both --deepscale_config {old} and --deepspeed_config {ds} are given: "
                          "keep --deepspeed_config (--deepscale_config is its deprecated "
                          "spelling)", key="deepspeed_config")
    return ds if ds is not None else old


def _same_config(a: Any, b: Any) -> bool:
    if isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)):
        return Path(a).resolve() == Path(b).resolve()
    return a is b or (isinstance(a, dict) and a == b)


def _pick_config(args, config, config_params) -> Any:
    if config is None:
        config = config_params
    from_args = _args_config(args)
    if from_args is not None and config is not None and not _same_config(from_args, config):
        shown = config if isinstance(config, (str, os.PathLike)) else type(config).__name__
        raise ConfigError(
            "two DeepSpeed configs: --deepspeed_config (args.deepspeed_config = "
            f"{str(from_args)!r}) and initialize(config={shown!r}); DeepSpeed refuses this "
            "(\"Not sure how to proceed\"): pass one of them", key="deepspeed_config")
    config = from_args if from_args is not None else config
    if config is None:
        raise ConfigError("no DeepSpeed config: run the script with --deepspeed_config FILE "
                          "(deepspeed.add_config_arguments(parser) adds it) or pass "
                          "initialize(config=path_or_dict)", key="deepspeed_config")
    return config


def _check_local_rank(args) -> None:
    """DeepSpeed's check of ``args.local_rank`` against the launcher's ``LOCAL_RANK``; the
    attribute is then set to it, as DeepSpeed's engine does."""
    if args is None or not hasattr(args, "local_rank"):
        return
    local = launch_env().local_rank
    given = args.local_rank
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0 and given != local:
        raise ConfigError(f"args.local_rank is {given} but the launcher set LOCAL_RANK={local}: "
                          "pass the --local_rank the launcher gives, or none", key="local_rank")
    try:
        args.local_rank = local
    except AttributeError:
        pass


def _hidden_size(model) -> int | None:
    """Hugging Face's rule for the bucket "auto" keys (the one zero.Init applies)."""
    from zeroio.partition.zero import _hidden_size as hidden_of

    return hidden_of(getattr(model, "config", None))


def _client_optimizer(optimizer, model, model_parameters):
    """A callable taking the parameters (DeepSpeed's ``DeepSpeedOptimizerCallable``) is called
    with them; an optimizer object is used as is."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        return optimizer, model_parameters
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    return optimizer(params), params


def _client_scheduler(lr_scheduler, optimizer):
    """A schedule callable gets DeepSpeed's "basic optimizer": the client's torch optimizer
    when there is one (zeroio's optimizer shares its param_groups, so a torch schedule's
    learning rates reach the step). Otherwise the engine calls it with its own optimizer."""
    if (callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
            and isinstance(optimizer, torch.optim.Optimizer)):
        return lr_scheduler(optimizer)
    return lr_scheduler


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = DEFAULT_PORT,
               mpu=None, dist_init_required: bool | None = None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: ``(engine, optimizer, dataloader, lr_scheduler)``.

    The config comes from ``config`` (or ``config_params``) or
    ``args.deepspeed_config``; both, when they differ, is an error. ``optimizer`` is
    a torch optimizer or a callable taking the parameters; ``lr_scheduler`` a
    schedule or a callable taking the optimizer. Either replaces the config's
    block. ``mpu`` and ``mesh_param`` (model and sequence parallelism) are not
    supported: zeroio is data-parallel."""
    if model is None:
        raise ConfigError("deepspeed.initialize requires a model", key="model")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ConfigError(f"initialize({name}=...) is model or sequence parallelism, which "
                              "zeroio does not implement (it is ZeRO data parallelism only)",
                              key=name)
    config = _pick_config(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required,
                     timeout=collective_timeout(config))
    _check_local_rank(args)
    optimizer, model_parameters = _client_optimizer(optimizer, model, model_parameters)
    lr_scheduler = _client_scheduler(lr_scheduler, optimizer)
    cfg = load_script_config(
        config, world_size=comm.world_size(), hidden_size=_hidden_size(model),
        client_optimizer=optimizer is not None, client_scheduler=lr_scheduler is not None,
        builds_loader=training_data is not None)
    from zeroio.engine import build

    # a frozen model (TRL's reference model) is built, as DeepSpeed builds it
    return build(model=model, config=cfg, model_parameters=model_parameters,
                 optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=training_data,
                 collate_fn=collate_fn, frozen_ok=True)
