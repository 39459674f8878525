"""The ``optimizer`` and ``scheduler`` sections: a type name and its params.

``type`` is kept as written (``"AdamW"``); ``name`` is its lower-case form,
the way DeepSpeed matches it. For the types DeepSpeed itself implements the
params are checked by name and type, and for Adam/AdamW, Lamb, Lion, Adagrad, SGD and the
five DeepSpeed learning-rate schedules the omitted params are filled with
DeepSpeed's defaults here, so the optimizer and scheduler code never holds a
second copy of a default.

[Note: DeepSpeed's Adam is AdamW]
DeepSpeed's ``"Adam"`` defaults to ``adam_w_mode: true`` (decoupled weight
decay, i.e. AdamW), and its AdamW's weight_decay defaults to 0.0, not
torch's 0.01. The filled params make both explicit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from zeroio.config.fields import (
    AUTO,
    as_bool,
    as_str,
    did_you_mean,
    fail,
    float_coercer,
    int_coercer,
    join,
)
from zeroio.errors import ConfigError

REQUIRED = object()


def _betas(value: Any, path: str) -> list[float]:
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                    and math.isfinite(b) and 0.0 <= b < 1.0 for b in value)):
        return [float(b) for b in value]
    raise fail(path, value, "a list of two numbers in [0, 1), e.g. [0.9, 0.999]")


def _warmup_type(value: Any, path: str) -> str:
    if value in ("log", "linear"):
        return value
    raise fail(path, value, '"log" or "linear"')


def _optional_int(value: Any, path: str) -> int | None:
    return None if value is None else int_coercer(ge=0)(value, path)


_LR = float_coercer(ge=0)
_STEPS = int_coercer(ge=0)
_RATIO = float_coercer(ge=0, le=1)
_LAST = int_coercer(ge=-1)

_ADAM_PARAMS = {
    "lr": (1e-3, _LR),
    "betas": ([0.9, 0.999], _betas),
    "eps": (1e-8, float_coercer(gt=0)),
    "weight_decay": (0.0, float_coercer(ge=0)),
    "bias_correction": (True, as_bool),
    "adam_w_mode": (True, as_bool),
    "amsgrad": (False, as_bool),
    "torch_adam": (False, as_bool),
    "fused": (None, lambda v, p: None if v is None else as_bool(v, p)),
}

def _false_only(value: Any, path: str) -> bool:
    if as_bool(value, path):
        raise fail(path, value, "false (zeroio's sharded optimizer does not implement it)")
    return False


_FALSE_ONLY = (False, _false_only)

# DeepSpeed's FusedLamb (its defaults; the trust ratio of each parameter is clamped to
# [min_coeff, max_coeff]); eps_inside_sqrt: sqrt(v + eps) instead of sqrt(v) + eps.
_LAMB_PARAMS = {
    "lr": (1e-3, _LR),
    "betas": ([0.9, 0.999], _betas),
    "eps": (1e-8, float_coercer(gt=0)),
    "eps_inside_sqrt": (False, as_bool),
    "weight_decay": (0.0, float_coercer(ge=0)),
    "bias_correction": (True, as_bool),
    "max_grad_norm": (0.0, float_coercer(ge=0)),
    "max_coeff": (10.0, float_coercer(gt=0)),
    "min_coeff": (0.01, float_coercer(ge=0)),
    "amsgrad": _FALSE_ONLY,
}
# DeepSpeed's FusedLion / DeepSpeedCPULion.
_LION_PARAMS = {
    "lr": (1e-3, _LR),
    "betas": ([0.9, 0.999], _betas),
    "weight_decay": (0.0, float_coercer(ge=0)),
}
# torch.optim.Adagrad (what DeepSpeed builds for "Adagrad" without offload).
_ADAGRAD_PARAMS = {
    "lr": (1e-2, _LR),
    "lr_decay": (0.0, float_coercer(ge=0)),
    "weight_decay": (0.0, float_coercer(ge=0)),
    "initial_accumulator_value": (0.0, float_coercer(ge=0)),
    "eps": (1e-10, float_coercer(gt=0)),
    "maximize": _FALSE_ONLY,
    "foreach": (None, lambda v, p: None if v is None else as_bool(v, p)),
    "differentiable": _FALSE_ONLY,
    "fused": (None, lambda v, p: None if v is None else as_bool(v, p)),
}
# torch.optim.SGD (DeepSpeed's fallback to torch.optim for "SGD").
_SGD_PARAMS = {
    "lr": (1e-3, _LR),
    "momentum": (0.0, float_coercer(ge=0)),
    "dampening": (0.0, float_coercer(ge=0)),
    "weight_decay": (0.0, float_coercer(ge=0)),
    "nesterov": (False, as_bool),
    "maximize": _FALSE_ONLY,
    "foreach": (None, lambda v, p: None if v is None else as_bool(v, p)),
    "differentiable": _FALSE_ONLY,
    "fused": (None, lambda v, p: None if v is None else as_bool(v, p)),
}

# Params of the optimizers and schedules DeepSpeed implements: name -> (default, coerce).
_OPTIMIZER_PARAMS: dict[str, dict[str, tuple[Any, Any]]] = {
    "adam": _ADAM_PARAMS, "adamw": _ADAM_PARAMS, "lamb": _LAMB_PARAMS, "lion": _LION_PARAMS,
    "adagrad": _ADAGRAD_PARAMS, "sgd": _SGD_PARAMS}

_WARMUP = {
    "warmup_min_lr": (0.0, _LR),
    "warmup_max_lr": (0.001, _LR),
    "warmup_num_steps": (1000, _STEPS),
    "warmup_type": ("log", _warmup_type),
    "last_batch_iteration": (-1, _LAST),
}
_SCHEDULER_PARAMS: dict[str, dict[str, tuple[Any, Any]]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": (REQUIRED, int_coercer(gt=0))},
    "WarmupCosineLR": {
        "total_num_steps": (REQUIRED, int_coercer(gt=0)),
        "warmup_min_ratio": (0.0, _RATIO),
        "warmup_num_steps": (1000, _STEPS),
        "cos_min_ratio": (0.0001, _RATIO),
        "warmup_type": ("log", _warmup_type),
        "last_batch_iteration": (-1, _LAST),
    },
    "OneCycle": {
        "cycle_min_lr": (REQUIRED, _LR),
        "cycle_max_lr": (REQUIRED, _LR),
        "decay_lr_rate": (0.0, float_coercer(ge=0)),
        "cycle_first_step_size": (2000, int_coercer(gt=0)),
        "cycle_second_step_size": (None, _optional_int),
        "cycle_first_stair_count": (0, _STEPS),
        "cycle_second_stair_count": (None, _optional_int),
        "decay_step_size": (0, _STEPS),
        "cycle_momentum": (True, as_bool),
        "cycle_min_mom": (0.8, _RATIO),
        "cycle_max_mom": (0.9, _RATIO),
        "decay_mom_rate": (0.0, float_coercer(ge=0)),
        "last_batch_iteration": (-1, _LAST),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": (0.001, _LR),
        "lr_range_test_step_size": (2000, int_coercer(gt=0)),
        "lr_range_test_step_rate": (1.0, float_coercer(gt=0)),
        "lr_range_test_staircase": (False, as_bool),
        "last_batch_iteration": (-1, _LAST),
    },
}

# DeepSpeed's own optimizers, then the torch.optim classes DeepSpeed falls back to.
KNOWN_OPTIMIZERS = (
    "Adam", "AdamW", "Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lion", "MuAdam",
    "MuAdamW", "MuSGD", "Muon", "Adagrad", "SGD", "Adadelta", "Adamax", "ASGD", "LBFGS",
    "NAdam", "RAdam", "RMSprop", "Rprop", "SparseAdam", "Adafactor",
)
KNOWN_SCHEDULERS = tuple(_SCHEDULER_PARAMS)


def _check_params(table: dict[str, tuple[Any, Any]], raw: Mapping, path: str) -> dict:
    params: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in table:
            raise ConfigError(
                f"unknown config key {join(path, str(key))}{did_you_mean(str(key), table)}",
                key=join(path, str(key)))
        params[key] = table[key][1](value, join(path, key))
    for key, (default, _) in table.items():
        if key not in params:
            if default is REQUIRED:
                raise ConfigError(f"{join(path, key)} is required for this type", key=join(path, key))
            params[key] = default
    return params


def _no_auto_left(value: Any, path: str) -> None:
    if isinstance(value, str) and value == AUTO:
        raise fail(path, value, "a value")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _no_auto_left(v, join(path, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_auto_left(v, f"{path}[{i}]")


def _type_and_params(raw: Any, path: str) -> tuple[str, Mapping]:
    if not isinstance(raw, Mapping):
        raise fail(path, raw, 'a JSON object {"type": ..., "params": {...}}')
    for key in raw:
        if key not in ("type", "params"):
            raise ConfigError(f"unknown config key {join(path, str(key))}"
                              f"{did_you_mean(str(key), ['type', 'params'])}",
                              key=join(path, str(key)))
    if "type" not in raw:
        raise ConfigError(f"{path}.type is required", key=f"{path}.type")
    type_ = as_str(raw["type"], f"{path}.type")
    params = raw.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise fail(f"{path}.params", params, "a JSON object")
    return type_, params


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``optimizer``: ``type`` as written and its ``params`` (read-only mapping)."""

    type: str
    """Optimizer name, e.g. "AdamW"; matched case-insensitively."""
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Constructor arguments; for the types zeroio steps (Adam, AdamW, Lamb, Lion, Adagrad,
    SGD) completed with DeepSpeed's (torch.optim's for Adagrad and SGD) defaults."""

    @property
    def name(self) -> str:
        return self.type.lower()


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``scheduler``: ``type`` as written and its ``params`` (read-only mapping)."""

    type: str
    """One of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest."""
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Schedule arguments, completed with DeepSpeed's defaults."""


def build_optimizer(raw: Any, path: str = "optimizer") -> OptimizerConfig | None:
    if raw is None:
        return None
    type_, raw_params = _type_and_params(raw, path)
    lower = {n.lower(): n for n in KNOWN_OPTIMIZERS}
    if type_.lower() not in lower:
        raise ConfigError(
            f"{path}.type = {type_!r}: not an optimizer DeepSpeed or torch.optim provides"
            f"{did_you_mean(type_, KNOWN_OPTIMIZERS)}", key=f"{path}.type")
    table = _OPTIMIZER_PARAMS.get(type_.lower())
    if table is None:
        _no_auto_left(raw_params, f"{path}.params")
        params = dict(raw_params)
    else:
        params = _check_params(table, raw_params, f"{path}.params")
        if type_.lower() == "adamw":
            if "adam_w_mode" in raw_params and not params["adam_w_mode"]:
                raise ConfigError(
                    f"{path}.params.adam_w_mode = false contradicts {path}.type = {type_!r}: "
                    'use type "Adam" with adam_w_mode false for L2-regularised Adam',
                    key=f"{path}.params.adam_w_mode")
            params["adam_w_mode"] = True
    return OptimizerConfig(type=type_, params=MappingProxyType(params))


def build_scheduler(raw: Any, path: str = "scheduler") -> SchedulerConfig | None:
    if raw is None:
        return None
    type_, raw_params = _type_and_params(raw, path)
    if type_ not in _SCHEDULER_PARAMS:
        raise ConfigError(
            f"{path}.type = {type_!r}: expected one of {', '.join(KNOWN_SCHEDULERS)}"
            f"{did_you_mean(type_, KNOWN_SCHEDULERS)}", key=f"{path}.type")
    params = _check_params(_SCHEDULER_PARAMS[type_], raw_params, f"{path}.params")
    return SchedulerConfig(type=type_, params=MappingProxyType(params))
