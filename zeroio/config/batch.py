"""Completing and checking the batch triple, as DeepSpeed does.

train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size.
Any two determine the third; one alone sets gradient_accumulation_steps to 1;
all three must multiply out. A conflict is a ConfigError, never a warning.

Deliberate difference: with none of the three given, DeepSpeed raises; zeroio
uses micro batch 1 and 1 accumulation step, so small configs and tests need
no batch keys. A key written as "auto" whose argument was not passed must be
derivable from the other two, or it is an error naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroio.config.fields import fail, int_coercer
from zeroio.errors import ConfigError

_POSITIVE = int_coercer(gt=0)
_NEEDS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "train_batch_size": "per_device_train_batch_size and gradient_accumulation_steps",
}


@dataclass(frozen=True, kw_only=True)
class BatchSizes:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def complete(raw: dict, world_size: int, unfilled_auto: set[str]) -> BatchSizes:
    train = raw.get("train_batch_size")
    micro = raw.get("train_micro_batch_size_per_gpu")
    gas = raw.get("gradient_accumulation_steps")
    train = None if train is None else _POSITIVE(train, "train_batch_size")
    micro = None if micro is None else _POSITIVE(micro, "train_micro_batch_size_per_gpu")
    gas = None if gas is None else _POSITIVE(gas, "gradient_accumulation_steps")

    def underivable(key: str) -> ConfigError:
        return ConfigError(
            f'{key} is "auto" but load_config was not given {_NEEDS[key]}, and the other '
            "batch keys do not determine it", key=key)

    given = sum(v is not None for v in (train, micro, gas))
    if given < 2 and unfilled_auto:
        # One key alone fixes the others only by assuming accumulation 1; an
        # unfilled "auto" must not be guessed that way.
        missing = [k for k in _NEEDS if k in unfilled_auto]
        raise underivable(missing[0])
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // (micro * world_size)
    elif train is not None and gas is not None:
        micro = train // (gas * world_size)
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas = 1
        micro = train // world_size
    elif micro is not None:
        gas = 1
        train = micro * world_size
    elif gas is not None:  # micro-steps of one sequence each, as with no key at all
        micro = 1
        train = gas * world_size
    else:
        micro, gas = 1, 1
        train = world_size
    if micro < 1 or gas < 1 or train != micro * gas * world_size:
        shown = {k: raw.get(k) if raw.get(k) is not None else "?" for k in _NEEDS}
        raise ConfigError(
            "inconsistent batch sizes: train_batch_size must equal "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size, but "
            f"{shown['train_batch_size']} != {shown['train_micro_batch_size_per_gpu']} x "
            f"{shown['gradient_accumulation_steps']} x {world_size} (? = not given; no positive "
            "integer fits)", key="train_batch_size")
    return BatchSizes(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                      gradient_accumulation_steps=gas)


__all__ = ["BatchSizes", "complete", "fail"]
