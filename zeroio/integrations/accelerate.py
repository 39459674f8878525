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

``check_launch`` (run by zeroio's ``TrainingArguments``, ``Trainer`` and
``initialize_from_accelerator``) raises a ``ConfigError`` naming the accelerate config to use
(configs/accelerate-zeroio.yaml) when accelerate started fewer processes than it was asked
for ([Note: the process count accelerate was asked for] in zeroio/config/accelerate_launch.py).

``distributed_type: DEEPSPEED`` makes accelerate start the DeepSpeed launcher,
which needs the ``deepspeed`` package; a process that still arrives with
``ACCELERATE_USE_DEEPSPEED=true`` gets a ``ConfigError`` saying which config to
use instead: the JSON file goes to ``TrainingArguments(deepspeed=...)``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeroio import jsonlimits
from zeroio.config.accelerate_launch import fewer_than_asked, requested_processes  # noqa: F401
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
    mismatch = fewer_than_asked(env, parent_argv)
    if mismatch is None:
        return
    requested, world = mismatch
    asked = "more than one process" if requested == 0 else f"{requested} processes"
    raise ConfigError(
        f"accelerate launch was asked for {asked} but started {world} (WORLD_SIZE="
        f"{env.get('WORLD_SIZE', 'unset')}): without --multi_gpu (or distributed_type: MULTI_GPU in "
        f"the accelerate config) accelerate runs a single process; launch with `accelerate launch "
        f"--config_file {ACCELERATE_CONFIG} --num_processes N`", key="num_processes")
