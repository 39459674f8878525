"""Scripts run under ``accelerate launch``.

``accelerate launch`` starts each process with the same ``RANK`` / ``WORLD_SIZE``
/ ``MASTER_ADDR`` environment as ``torchrun``, so a plain script calling
``zeroio.initialize`` needs nothing from this module. A script that already
builds an ``accelerate.Accelerator`` can let it fill the config's "auto" keys
(world size, gradient accumulation, mixed precision) the way the Trainer
integration fills them from TrainingArguments::

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="no")
    engine, optimizer, loader, sched = initialize_from_accelerator(
        accelerator, model, "configs/zero3.json", per_device_train_batch_size=4,
        learning_rate=3e-4)

The engine then owns backward and step (``engine.backward(loss); engine.step()``);
do not also ``accelerator.prepare`` the model or optimizer, which would wrap
them in DDP a second time.

[Note: the process count accelerate was asked for]
``accelerate launch --num_processes 2 script.py`` without ``--multi_gpu`` (or a
config whose ``distributed_type`` is not ``MULTI_GPU``) starts *one* process
and says nothing. ``check_launch`` (run by zeroio's ``TrainingArguments``,
``Trainer`` and ``initialize_from_accelerator``) finds the count that was
asked for in the launching ``accelerate launch`` command line (the parent
process: ``--num_processes``, else the ``--config_file``'s or the default
config's ``num_processes``) and compares it with ``WORLD_SIZE``; a mismatch is
a ``ConfigError`` naming the accelerate config to use
(configs/accelerate-zeroio.yaml). Where the parent's command line cannot be
read, a process that accelerate's single-process launcher started with a
``MASTER_ADDR`` (which it sets only for more than one process) but no
``WORLD_SIZE`` is the same error.

``distributed_type: DEEPSPEED`` makes accelerate start the DeepSpeed launcher,
which needs the ``deepspeed`` package; a process that still arrives with
``ACCELERATE_USE_DEEPSPEED=true`` gets a ``ConfigError`` saying which config to
use instead: the JSON file goes to ``TrainingArguments(deepspeed=...)``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeroio import jsonlimits
from zeroio.config.launch_env import launch_env
from zeroio.errors import ConfigError
from zeroio.integrations.autofill import check_no_contradictions


def accelerator_values(accelerator) -> dict[str, Any]:
    """The ``load_config`` keyword values an ``Accelerator`` stands for."""
    precision = str(getattr(accelerator, "mixed_precision", "no"))
    return dict(
        world_size=accelerator.num_processes,
        gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
        fp16=precision == "fp16",
        bf16=precision == "bf16",
    )


def initialize_from_accelerator(accelerator, model, config, **auto_values: Any):
    """``zeroio.initialize`` with "auto" filled from ``accelerator`` and ``auto_values``.

    ``auto_values`` are ``load_config``'s TrainingArguments-style names
    (``per_device_train_batch_size``, ``learning_rate``, ...). An explicit config
    value contradicting either source is a ``ConfigError``.
    """
    import zeroio

    check_launch()
    if isinstance(config, dict):
        raw = copy.deepcopy(config)
    else:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config {path} does not exist", key="config")
        try:
            raw = jsonlimits.loads(path.read_text(), f"config {path}")
        except jsonlimits.JSONLimitError as e:
            raise ConfigError(str(e), key="config") from None
        except ValueError as e:
            raise ConfigError(f"config {path} is not valid JSON: {e}", key="config") from None
    values = {**accelerator_values(accelerator), **auto_values}
    check_no_contradictions(raw, "the Accelerator and arguments", **values)
    cfg = zeroio.load_config(raw, **values)
    return zeroio.initialize(model=model, config=cfg)


ACCELERATE_CONFIG = "configs/accelerate-zeroio.yaml"


def _parent_argv() -> list[str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _option(argv: Sequence[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.endswith(".py") or arg == "-m":  # the training script: its own options follow
            return None
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _config_processes(path: str | None) -> int | None:
    if path is None:
        try:
            from accelerate.commands.config import default_config_file
        except ImportError:
            return None
        path = default_config_file
    p = Path(path)
    if not p.is_file():
        return None
    try:
        if p.suffix == ".json":
            data = jsonlimits.loads(p.read_text(), f"accelerate config {p}")
        else:
            import yaml

            data = yaml.safe_load(p.read_text())
        n = data.get("num_processes") if isinstance(data, dict) else None
    except (ValueError, ImportError, OSError, AttributeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def requested_processes(environ: Mapping[str, str] | None = None,
                        parent_argv: Sequence[str] | None = None) -> int | None:
    """The process count ``accelerate launch`` was asked for, when it started this process.

    None when this process was not started by ``accelerate launch`` or the count is
    unknown; 0 when it is known to be more than one but not how many (see the note).
    """
    env = launch_env().variables if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" not in env:  # set by every accelerate launcher
        return None
    argv = _parent_argv() if parent_argv is None else list(parent_argv)
    if argv and "launch" in argv and any("accelerate" in a for a in argv[:3]):
        n = _option(argv, "--num_processes", "--num-processes")
        if n is not None:
            return int(n) if n.isdigit() else None
        return _config_processes(_option(argv, "--config_file", "--config-file"))
    if not argv and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        return 0
    return None


def check_launch(environ: Mapping[str, str] | None = None,
                 parent_argv: Sequence[str] | None = None) -> None:
    """Raise ``ConfigError`` when accelerate started a different number of processes than asked,
    or launched this process for DeepSpeed (see [Note: the process count accelerate was asked for])."""
    env = launch_env().variables if environ is None else environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
        raise ConfigError(
            "accelerate launched this script for DeepSpeed (distributed_type: DEEPSPEED); zeroio "
            f"takes DeepSpeed's place: launch with `accelerate launch --config_file "
            f"{ACCELERATE_CONFIG}` (distributed_type: MULTI_GPU) and give the DeepSpeed JSON file "
            "(the accelerate config's deepspeed_config_file) as TrainingArguments(deepspeed=...) "
            "or --deepspeed; or keep the DEEPSPEED config and use transformers' own Trainer and "
            "TrainingArguments, which run on zeroio through the deepspeed facade "
            "(docs/transformers.md)", key="distributed_type")
    requested = requested_processes(env, parent_argv)
    if requested is None:
        return
    world = int(env.get("WORLD_SIZE", "1"))
    if requested == world:
        return
    asked = "more than one process" if requested == 0 else f"{requested} processes"
    raise ConfigError(
        f"accelerate launch was asked for {asked} but started {world} (WORLD_SIZE="
        f"{env.get('WORLD_SIZE', 'unset')}): without --multi_gpu (or distributed_type: MULTI_GPU in "
        f"the accelerate config) accelerate runs a single process; launch with `accelerate launch "
        f"--config_file {ACCELERATE_CONFIG} --num_processes N`", key="num_processes")
