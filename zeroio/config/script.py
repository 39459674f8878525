"""A config written for the Hugging Face Trainer, read by a plain DeepSpeed-style script.

Hugging Face's DeepSpeed docs write their configs with ``"auto"`` values that
the Trainer fills from its ``TrainingArguments``. The same file handed to
``deepspeed.initialize`` by a script with no Trainer (``zeroio.deepspeed``)
is read by ``load_script_config``, which fills what the script's run
determines and is an error only for what training truly needs:

- filled: ``world_size`` (the ranks running); the bucket and persistence keys
  from ``hidden_size`` (the model config's, Hugging Face's rule) where one is
  known; ``scheduler.params.warmup_max_lr`` from the config's own numeric
  ``optimizer.params.lr`` (the Trainer's rule: the peak is the learning rate);
  ``warmup_min_lr`` is 0 as in the Trainer;
- as if absent (the key's DeepSpeed default; one ``ConfigWarning`` lists them):
  the batch keys (batch.py completes the triple from what is given; none given
  is micro batch 1, one accumulation step), ``gradient_clipping`` (0: no
  clipping), ``fp16``/``bf16`` ``enabled`` (off), and the optimizer's ``betas``,
  ``eps`` and ``weight_decay``;
- an error naming the key: the optimizer's ``lr`` and the schedule's step
  counts (``warmup_num_steps``, ``total_num_steps``), which have no value a
  script could mean by "auto"; ``train_micro_batch_size_per_gpu`` when
  ``initialize`` builds a data loader (``training_data``), whose batch it is.
  A client optimizer (``optimizer=``) or schedule (``lr_scheduler=``) replaces
  the config's block, as in DeepSpeed, so that block's "auto" keys cannot matter.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from zeroio.config import legacy
from zeroio.config.auto import BATCH_KEYS, RULES, check_auto_values, drop_unfillable
from zeroio.config.fields import AUTO
from zeroio.config.legacy import ConfigWarning
from zeroio.errors import ConfigError

#: "auto" keys a script must write itself: what each one is in the Trainer.
NEEDED = {
    "optimizer.params.lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps",
    "scheduler.params.total_num_steps": "the Trainer's number of training steps",
}


def _get(raw: Mapping, path: str) -> Any:
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def script_raw(raw: dict[str, Any], *, world_size: int, hidden_size: int | None = None,
               client_optimizer: bool = False, client_scheduler: bool = False,
               builds_loader: bool = False) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(raw config, auto values to fill it with, the "auto" paths taken as absent) for a
    script without TrainingArguments (see the module docstring). ``raw``: the JSON object
    after ``legacy.rewrite``."""
    raw = dict(raw)
    if client_optimizer:
        raw.pop("optimizer", None)
    if client_scheduler:
        raw.pop("scheduler", None)
    for path, fills in NEEDED.items():
        if _get(raw, path) == AUTO:
            raise ConfigError(
                f'{path} is "auto", which only the Hugging Face Trainer fills (from {fills}); '
                "a script without a Trainer must write the value in the config", key=path)
    if builds_loader and _get(raw, "train_micro_batch_size_per_gpu") == AUTO:
        raise ConfigError(
            'train_micro_batch_size_per_gpu is "auto" but initialize(training_data=...) builds '
            "the data loader whose batch it is: write the micro batch size in the config",
            key="train_micro_batch_size_per_gpu")
    values: dict[str, Any] = {"world_size": world_size}
    if hidden_size is not None:
        values["hidden_size"] = hidden_size
    lr = _number(_get(raw, "optimizer.params.lr"))
    if lr is not None:
        values["learning_rate"] = lr
    values = check_auto_values(values)
    raw, dropped = drop_unfillable(raw, values)
    return raw, values, [p for p in dropped if p in RULES]


def load_script_config(path_or_dict: Any, *, world_size: int, hidden_size: int | None = None,
                       client_optimizer: bool = False, client_scheduler: bool = False,
                       builds_loader: bool = False):
    """``load_config`` for a DeepSpeed-style script with no Trainer: "auto" values are filled
    or taken as absent as the module docstring says, with one ``ConfigWarning`` naming the
    keys taken as absent."""
    from zeroio.config.loader import Config, load_config, read_config

    if isinstance(path_or_dict, Config):
        return path_or_dict
    raw, values, absent = script_raw(
        legacy.rewrite(read_config(path_or_dict)), world_size=world_size,
        hidden_size=hidden_size, client_optimizer=client_optimizer,
        client_scheduler=client_scheduler, builds_loader=builds_loader)
    if absent:
        batch = [p for p in absent if p in BATCH_KEYS]
        rest = [p for p in absent if p not in BATCH_KEYS]
        warnings.warn(ConfigWarning(
            '"auto" with no Trainer to fill it: ' + ", ".join(batch + rest) + " take their "
            "DeepSpeed defaults (as if absent); write values to choose them"), stacklevel=2)
    return load_config(raw, **values)


__all__ = ["NEEDED", "load_script_config", "script_raw"]
