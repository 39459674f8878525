"""Turn the config's ``optimizer`` block or a client torch optimizer into hyperparameter groups.

A client optimizer is accepted as DeepSpeed accepts one: its ``param_groups``
say which parameters train and with which hyperparameters, its class says
the update rule (``torch.optim.AdamW`` -> decoupled decay, ``torch.optim.Adam``
-> L2 decay, ``decoupled_weight_decay=True`` honoured). zeroio then steps its
own sharded equivalent, sharing the client's group dicts so that a client
scheduler bound to the client optimizer still drives the learning rate. Other
classes are stepped as themselves on the shards (``from_client``), except a class that names
zeroio's rule for it in a ``zeroio_rule`` attribute (one of ``RULE_TYPES``: the facade's
``FusedLamb``, ``DeepSpeedCPULion``, ...), whose groups are that rule's hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeroio.errors import ConfigError

SUPPORTED = ("adam", "adamw", "lamb", "lion", "adagrad", "sgd")
RULE_TYPES = ("lamb", "lion", "adagrad", "sgd")
"""Types stepped by ``ShardedRule`` (rules.py) rather than the Adam kernels."""
_NOT_HYPER = ("foreach", "differentiable", "fused", "maximize", "amsgrad", "max_grad_norm")


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    param_groups: list[list[torch.nn.Parameter]]
    """Trainable parameters of each group."""
    hyper: list[dict]
    """Per group: lr, betas, eps, weight_decay (dicts schedulers may mutate)."""
    decoupled: bool
    """AdamW-style (decoupled) weight decay."""
    type_name: str
    rule: str = "adam"
    """"adam" (Adam and AdamW), one of ``RULE_TYPES``, or "client" (``client``'s own class
    stepped on the shards: optim/client_shards.py)."""
    client: torch.optim.Optimizer | None = None
    """The client optimizer whose class steps the shards (rule "client")."""


def require_trainable(spec: OptimizerSpec, module: torch.nn.Module) -> OptimizerSpec:
    """``spec`` when it trains at least one parameter; else a ConfigError saying so (an engine
    over a frozen model would step nothing, silently)."""
    if any(p.requires_grad for group in spec.param_groups for p in group):
        return spec
    total = sum(1 for _ in module.parameters())
    raise ConfigError(
        f"initialize: nothing to train: the optimizer's groups hold no parameter with "
        f"requires_grad=True (the model has {total} parameter tensor(s); frozen ones are "
        "skipped). Unfreeze the parameters to train (p.requires_grad_(True)), or pass them as "
        "model_parameters / in the optimizer's param_groups", key="model_parameters")


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
                          "sharded optimizer; use one of \"Adam\", \"AdamW\", \"Lamb\", "
                          "\"Lion\", \"Adagrad\", \"SGD\" (OneBitLamb's compressed "
                          "communication is not implemented: use \"Lamb\")", key="optimizer.type")
    p = dict(optimizer_cfg.params)
    if optimizer_cfg.name in RULE_TYPES:
        return _rule_spec(optimizer_cfg, p, module, model_parameters)
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


def _rule_spec(optimizer_cfg, p: dict, module, model_parameters) -> OptimizerSpec:
    """A spec for a ``RULE_TYPES`` optimizer: the config's params (completed by the config
    layer) as each group's defaults, a group's own keys over them."""
    if float(p.get("max_grad_norm", 0.0)):
        raise ConfigError("optimizer.params.max_grad_norm: zeroio clips by gradient_clipping; "
                          "set max_grad_norm to 0 and gradient_clipping to the norm",
                          key="optimizer.params.max_grad_norm")
    defaults = {k: v for k, v in p.items() if k not in _NOT_HYPER}
    if "betas" in defaults:
        defaults["betas"] = tuple(float(b) for b in defaults["betas"])
    groups = _groups_from(model_parameters, module)
    hyper = [dict(defaults, **{k: g[k] for k in defaults if k in g}) for g in groups]
    return OptimizerSpec(param_groups=[g["params"] for g in groups], hyper=hyper,
                         decoupled=False, type_name=optimizer_cfg.type, rule=optimizer_cfg.name)


def from_client(optimizer: torch.optim.Optimizer, cfg=None) -> OptimizerSpec:
    """A client optimizer -> spec sharing its group dicts. ``torch.optim.Adam``/``AdamW`` (and
    their subclasses) are stepped by zeroio's Adam; any other class by itself over the shards
    (rule "client"). With
    optimizer offload and ``zero_force_ds_cpu_optimizer: true`` (DeepSpeed's default) a
    non-Adam client optimizer is refused, as DeepSpeed refuses it. ``cfg``: the engine's
    ``Config`` (None: no offload, the flag's default)."""
    name = type(optimizer).__name__
    offload = cfg is not None and cfg.zero_optimization.offload_optimizer.device != "none"
    force = cfg is None or cfg.zero_force_ds_cpu_optimizer
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        # the same update as zeroio's Adam, whatever the flag says (accelerate sets it false
        # beside its own DeepSpeedCPUAdam, and Adam's hyperparameters carry over exactly)
        return _client_adam(optimizer)
    rule = getattr(type(optimizer), "zeroio_rule", None)
    if rule in RULE_TYPES:  # a class that names zeroio's rule for it (deepspeed.ops' classes)
        return _client_rule(optimizer, rule)
    if offload and force:
        raise ConfigError(f"client optimizer {name} with offload_optimizer: zeroio steps its own "
                          "CPU optimizer there (DeepSpeed's rule); configure optimizer.type in "
                          "the config, pass torch.optim.Adam/AdamW, or set "
                          "zero_force_ds_cpu_optimizer to false to step "
                          f"{name} itself on the offloaded shards", key="zero_force_ds_cpu_optimizer")
    return OptimizerSpec(
        param_groups=[[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups],
        hyper=optimizer.param_groups, decoupled=False, type_name=name, rule="client",
        client=optimizer)


def _client_rule(optimizer, rule: str) -> OptimizerSpec:
    """A client optimizer whose class declares ``zeroio_rule`` (one of ``RULE_TYPES``): its
    groups (shared, so a scheduler's lr reaches the step) are that rule's hyperparameters."""
    name = type(optimizer).__name__
    for g in optimizer.param_groups:
        if float(g.get("max_grad_norm", 0.0)):
            raise ConfigError(f"client {name}(max_grad_norm={g['max_grad_norm']}): zeroio clips "
                              "by gradient_clipping; pass max_grad_norm=0 and set "
                              "gradient_clipping to the norm", key="gradient_clipping")
    return OptimizerSpec(
        param_groups=[[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups],
        hyper=optimizer.param_groups, decoupled=False, type_name=name, rule=rule)


def _client_adam(optimizer) -> OptimizerSpec:
    name = type(optimizer).__name__
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise ConfigError(f"client {name}: amsgrad/maximize are not supported by zeroio's "
                              "Adam; set zero_force_ds_cpu_optimizer false with offload, or "
                              "drop them", key="optimizer")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay", False))
    return OptimizerSpec(
        param_groups=[[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups],
        hyper=optimizer.param_groups, decoupled=decoupled, type_name=name)
