"""Turn the config's ``optimizer`` block or a client torch optimizer into hyperparameter groups.

A client optimizer is accepted as DeepSpeed accepts one: its ``param_groups``
say which parameters train and with which hyperparameters, its class says
the update rule (``torch.optim.AdamW`` -> decoupled decay, ``torch.optim.Adam``
-> L2 decay, ``decoupled_weight_decay=True`` honoured). zeroio then steps its
own sharded equivalent, sharing the client's group dicts so that a client
scheduler bound to the client optimizer still drives the learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeroio.errors import ConfigError

SUPPORTED = ("adam", "adamw")


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    param_groups: list[list[torch.nn.Parameter]]
    """Trainable parameters of each group."""
    hyper: list[dict]
    """Per group: lr, betas, eps, weight_decay (dicts schedulers may mutate)."""
    decoupled: bool
    """AdamW-style (decoupled) weight decay."""
    type_name: str


def _hyper(d: dict) -> dict:
    return {"lr": float(d["lr"]), "betas": tuple(float(b) for b in d["betas"]),
            "eps": float(d["eps"]), "weight_decay": float(d.get("weight_decay", 0.0))}


def _groups_from(model_parameters: Any, module: torch.nn.Module) -> list[dict]:
    if model_parameters is None:
        model_parameters = module.parameters()
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in items]
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": [p for p in items if p.requires_grad]}]


def from_config(optimizer_cfg, module: torch.nn.Module, model_parameters: Any) -> OptimizerSpec:
    """``cfg.optimizer`` (params completed by the config layer) -> spec; other types raise."""
    if optimizer_cfg is None:
        raise ConfigError("no optimizer: give the config an optimizer block "
                          '({"type": "AdamW", "params": {"lr": ...}}) or pass optimizer=',
                          key="optimizer")
    if optimizer_cfg.name not in SUPPORTED:
        raise ConfigError(f"optimizer.type = {optimizer_cfg.type!r} is not supported by zeroio's "
                          f"sharded optimizer; use \"Adam\" or \"AdamW\"", key="optimizer.type")
    p = dict(optimizer_cfg.params)
    for key in ("amsgrad",):
        if p.get(key):
            raise ConfigError(f"optimizer.params.{key} = true is not supported; set it to false",
                              key=f"optimizer.params.{key}")
    if not p.get("bias_correction", True):
        raise ConfigError("optimizer.params.bias_correction = false is not supported",
                          key="optimizer.params.bias_correction")
    defaults = _hyper(p)
    groups = _groups_from(model_parameters, module)
    hyper = [dict(defaults, **{k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g})
             for g in groups]
    hyper = [_hyper(h) for h in hyper]
    decoupled = optimizer_cfg.name == "adamw" or bool(p.get("adam_w_mode", True))
    return OptimizerSpec(param_groups=[g["params"] for g in groups], hyper=hyper,
                         decoupled=decoupled, type_name=optimizer_cfg.type)


def from_client(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """A client ``torch.optim.Adam``/``AdamW`` -> spec sharing its group dicts."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ConfigError(f"client optimizer {name} is not supported: pass torch.optim.Adam or "
                          "torch.optim.AdamW, or configure optimizer.type in the config",
                          key="optimizer")
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise ConfigError(f"client {name}: amsgrad/maximize are not supported", key="optimizer")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay", False))
    return OptimizerSpec(
        param_groups=[[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups],
        hyper=optimizer.param_groups, decoupled=decoupled, type_name=name)
