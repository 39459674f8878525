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
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

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

    if isinstance(config, dict):
        raw = copy.deepcopy(config)
    else:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config {path} does not exist", key="config")
        raw = json.loads(path.read_text())
    values = {**accelerator_values(accelerator), **auto_values}
    check_no_contradictions(raw, "the Accelerator and arguments", **values)
    cfg = zeroio.load_config(raw, **values)
    return zeroio.initialize(model=model, config=cfg)
