"""Filling ``"auto"`` values from the keyword arguments of ``load_config``.

The rules are Hugging Face Transformers' (integrations/deepspeed.py), so a
config written for the HF Trainer means the same thing here: batch keys
from the Trainer's batch arguments, optimizer and scheduler params from its
hyper-parameters, and the ZeRO bucket sizes from the model's hidden size
(reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
stage3_param_persistence_threshold = 10*h).

An "auto" whose argument was not passed is an error naming the argument,
except for the batch keys: those are left unset and the batch triple is
completed from the other two when it can be (batch.py reports it otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zeroio.config.fields import AUTO, did_you_mean, join, show
from zeroio.errors import ConfigError


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"load_config({name}={show(value)}): expected a positive integer", key=name)


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f"load_config({name}={show(value)}): expected an integer >= 0", key=name)


def _number(name: str, value: Any) -> float:
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        return float(value)
    raise ConfigError(f"load_config({name}={show(value)}): expected a finite number >= 0",
                      key=name)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"load_config({name}={show(value)}): expected True or False", key=name)


# The keyword arguments load_config accepts, with their checks.
AUTO_VALUE_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "world_size": _positive_int,
    "hidden_size": _positive_int,
    "per_device_train_batch_size": _positive_int,
    "gradient_accumulation_steps": _positive_int,
    "learning_rate": _number,
    "adam_beta1": _number,
    "adam_beta2": _number,
    "adam_epsilon": _number,
    "weight_decay": _number,
    "max_grad_norm": _number,
    "fp16": _flag,
    "bf16": _flag,
    "num_training_steps": _nonneg_int,
    "warmup_steps": _nonneg_int,
}

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_auto_values(auto_values: Mapping[str, Any]) -> dict[str, Any]:
    """Validated keyword arguments; None means "not given"."""
    out = {}
    for name, value in auto_values.items():
        if name not in AUTO_VALUE_CHECKS:
            raise ConfigError(
                f"load_config got an unexpected keyword argument {name!r}"
                f"{did_you_mean(name, AUTO_VALUE_CHECKS)}; accepted: "
                + ", ".join(AUTO_VALUE_CHECKS), key=name)
        if value is not None:
            out[name] = AUTO_VALUE_CHECKS[name](name, value)
    return out


@dataclass(frozen=True)
class _Rule:
    needs: tuple[str, ...]
    value: Callable[[dict[str, Any]], Any]


_RULES: dict[str, _Rule] = {
    "train_micro_batch_size_per_gpu": _Rule(("per_device_train_batch_size",),
                                            lambda v: v["per_device_train_batch_size"]),
    "gradient_accumulation_steps": _Rule(("gradient_accumulation_steps",),
                                         lambda v: v["gradient_accumulation_steps"]),
    "train_batch_size": _Rule(
        ("per_device_train_batch_size", "gradient_accumulation_steps"),
        lambda v: v.get("world_size", 1) * v["per_device_train_batch_size"]
        * v["gradient_accumulation_steps"]),
    "gradient_clipping": _Rule(("max_grad_norm",), lambda v: v["max_grad_norm"]),
    "fp16.enabled": _Rule(("fp16",), lambda v: v["fp16"]),
    "bf16.enabled": _Rule(("bf16",), lambda v: v["bf16"]),
    "optimizer.params.lr": _Rule(("learning_rate",), lambda v: v["learning_rate"]),
    "optimizer.params.betas": _Rule(("adam_beta1", "adam_beta2"),
                                    lambda v: [v["adam_beta1"], v["adam_beta2"]]),
    "optimizer.params.eps": _Rule(("adam_epsilon",), lambda v: v["adam_epsilon"]),
    "optimizer.params.weight_decay": _Rule(("weight_decay",), lambda v: v["weight_decay"]),
    "scheduler.params.warmup_min_lr": _Rule((), lambda v: 0.0),
    "scheduler.params.warmup_max_lr": _Rule(("learning_rate",), lambda v: v["learning_rate"]),
    "scheduler.params.warmup_num_steps": _Rule(("warmup_steps",), lambda v: v["warmup_steps"]),
    "scheduler.params.total_num_steps": _Rule(("num_training_steps",),
                                              lambda v: v["num_training_steps"]),
}
_HIDDEN_RULES = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
    "param_persistence_threshold": lambda h: 10 * h,
}
for _key, _fn in _HIDDEN_RULES.items():
    _RULES[f"zero_optimization.{_key}"] = _Rule(("hidden_size",),
                                                lambda v, _fn=_fn: _fn(v["hidden_size"]))


def _fill(container: dict[str, Any], key: str, path: str, values: dict[str, Any],
          unfilled_batch: set[str]) -> None:
    rule = _RULES[path]
    missing = [n for n in rule.needs if n not in values]
    if not missing:
        container[key] = rule.value(values)
    elif path in BATCH_KEYS:
        del container[key]
        unfilled_batch.add(path)
    else:
        raise ConfigError(
            f'{path} is "auto" but load_config was not given '
            + " and ".join(f"{n}=..." for n in missing)
            + " to fill it", key=path)


def resolve_auto(raw: dict[str, Any], values: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A copy of ``raw`` with every fillable "auto" replaced.

    Returns it with the batch keys that were "auto" and could not be filled
    (removed from the copy). An "auto" anywhere else is left in place for the
    field's own check to reject, with a message saying it cannot be filled.
    """
    out = dict(raw)
    unfilled: set[str] = set()
    for path in _RULES:
        parts = path.split(".")
        parent: Any = out
        ok = True
        for part in parts[:-1]:
            child = parent.get(part) if isinstance(parent, Mapping) else None
            if not isinstance(child, Mapping):
                ok = False
                break
            child = dict(child)
            parent[part] = child
            parent = child
        if ok and isinstance(parent, dict) and parent.get(parts[-1]) == AUTO:
            _fill(parent, parts[-1], path, values, unfilled)
    return out, unfilled


def drop_unfillable(raw: dict[str, Any], values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``raw`` without the "auto" entries that ``values`` cannot fill, and their paths.

    What ``zero.Init`` reads of a config written for the Trainer: it needs the
    stage, the 16-bit switches and the zero_optimization block, not the
    learning rate or batch sizes, so an "auto" it cannot fill takes the key's
    default instead of being an error (the later ``load_config`` with the
    Trainer's arguments still fills or rejects it).
    """
    out = dict(raw)
    dropped = []
    for path, rule in _RULES.items():
        parts = path.split(".")
        parent: Any = out
        for part in parts[:-1]:
            child = parent.get(part) if isinstance(parent, Mapping) else None
            if not isinstance(child, Mapping):
                parent = None
                break
            parent[part] = dict(child)
            parent = parent[part]
        if (isinstance(parent, dict) and parent.get(parts[-1]) == AUTO
                and any(n not in values for n in rule.needs)):
            del parent[parts[-1]]
            dropped.append(path)
    return out, dropped


# Public name of the rule table (integrations/autofill.py compares explicit values against it).
RULES = _RULES

__all__ = ["AUTO", "AUTO_VALUE_CHECKS", "BATCH_KEYS", "RULES", "check_auto_values", "drop_unfillable",
           "resolve_auto", "join"]
