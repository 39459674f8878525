"""The zeroio config a Trainer run uses, built from the user's JSON and TrainingArguments.

[Note: optim and lr_scheduler_type]
A DeepSpeed config's ``optimizer`` / ``scheduler`` blocks win over
TrainingArguments' ``optim`` / ``lr_scheduler_type``, as in transformers'
DeepSpeed integration. Where a block is absent, the argument is honoured by
mapping it to the zeroio equivalent, and an argument zeroio cannot honour is
a ``ConfigError`` naming what it supports, never a silent AdamW:

- ``optim``: zeroio's sharded optimizer is Adam/AdamW. HF's AdamW family
  (``adamw_torch``, ``adamw_torch_fused``, ``adamw_torch_xla``,
  ``adamw_torch_npu_fused``, ``adamw_apex_fused``) computes the same update
  (decoupled weight decay, ``adam_beta1/2``, ``adam_epsilon``); the kernel
  choice is zeroio's, so all of them map to ``AdamW``. Every other name
  (``sgd``, ``adafactor``, 8-bit, Lion, GaLore, ...) is refused, as is
  ``optim_args`` (no zeroio counterpart). With an ``optimizer`` block
  present, an ``optim`` outside the AdamW family contradicts it: refused too.
- ``lr_scheduler_type``: ``linear`` -> WarmupDecayLR, ``constant_with_warmup``
  -> WarmupLR (linear warmup), ``constant`` -> WarmupLR without warmup; other
  types are refused. With a ``scheduler`` block present, a non-default type
  (anything but ``linear``) that maps to a different zeroio schedule, or has
  no mapping, is refused.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from zeroio import jsonlimits
from zeroio.errors import ConfigError

ADAMW_FAMILY = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused",
                "adamw_apex_fused")

SCHEDULERS = {
    "linear": ("WarmupDecayLR", {"total_num_steps": "auto"}),
    "constant_with_warmup": ("WarmupLR", {}),
    "constant": ("WarmupLR", {}),
}


def read_config(config: str | os.PathLike | dict, key: str = "zeroio_config") -> dict[str, Any]:
    """A private copy of ``config`` (a dict, or a JSON file's contents)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"{key} {path} does not exist", key=key)
    try:
        raw = jsonlimits.loads(path.read_text(), f"{key} {path}")
    except jsonlimits.JSONLimitError as e:
        raise ConfigError(str(e), key=key) from None
    except ValueError as e:
        raise ConfigError(f"{key} {path} is not valid JSON: {e}", key=key) from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{key} {path} holds {type(raw).__name__}, not a JSON object", key=key)
    return raw


def _name(value) -> str:
    return str(getattr(value, "value", value))


def _check_optim(raw: dict[str, Any], args) -> None:
    optim = _name(args.optim)
    supported = ", ".join(ADAMW_FAMILY)
    if getattr(args, "optim_args", None):
        raise ConfigError(
            f"TrainingArguments optim_args={args.optim_args!r} has no zeroio equivalent; drop it "
            'and put the values in the zeroio config\'s "optimizer" block', key="optim_args")
    if optim in ADAMW_FAMILY:
        return
    if "optimizer" in raw:
        raise ConfigError(
            f"TrainingArguments optim={optim!r} contradicts the zeroio config's optimizer.type = "
            f"{raw['optimizer'].get('type')!r}: drop optim (or set it to adamw_torch)",
            key="optimizer.type")
    raise ConfigError(
        f"TrainingArguments optim={optim!r} is not supported by zeroio, whose sharded optimizer is "
        f"Adam/AdamW: use optim= one of {supported} (all run zeroio's AdamW), or give the zeroio "
        'config an "optimizer" block of type "Adam" or "AdamW"', key="optim")


def _scheduler_block(kind: str) -> dict[str, Any]:
    if kind not in SCHEDULERS:
        raise ConfigError(
            f"TrainingArguments lr_scheduler_type={kind!r} has no zeroio equivalent; use one of "
            f"{', '.join(SCHEDULERS)} or put a \"scheduler\" block in the zeroio config",
            key="lr_scheduler_type")
    name, extra = SCHEDULERS[kind]
    warmup = 0 if kind == "constant" else "auto"
    return {"type": name, "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": warmup,
        "warmup_type": "linear", **extra}}


def _check_scheduler_block(raw: dict[str, Any], kind: str) -> None:
    if kind == "linear":  # the default: the config's block wins, as with DeepSpeed
        return
    given = raw["scheduler"].get("type") if isinstance(raw["scheduler"], dict) else None
    mapped = SCHEDULERS.get(kind, (None,))[0]
    if mapped is None or mapped != given:
        raise ConfigError(
            f"TrainingArguments lr_scheduler_type={kind!r} contradicts the zeroio config's "
            f"scheduler.type = {given!r}: drop lr_scheduler_type or the scheduler block",
            key="scheduler.type")


def complete_config(raw: dict[str, Any], args) -> dict[str, Any]:
    """``raw`` with ``optim`` / ``lr_scheduler_type`` honoured where it has no block of its own.

    See [Note: optim and lr_scheduler_type]; the batch keys and ``gradient_clipping``
    default to "auto" (filled from ``args``).
    """
    out = copy.deepcopy(raw)
    _check_optim(out, args)
    out.setdefault("optimizer", {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}})
    kind = _name(args.lr_scheduler_type)
    if "scheduler" in out:
        _check_scheduler_block(out, kind)
    else:
        out["scheduler"] = _scheduler_block(kind)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size",
                "gradient_clipping"):
        out.setdefault(key, "auto")
    return out


def auto_values(args, model=None, num_training_steps: int | None = None) -> dict[str, Any]:
    """The ``load_config`` keyword values TrainingArguments ``args`` stand for."""
    values: dict[str, Any] = dict(
        world_size=args.world_size,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        fp16=bool(args.fp16), bf16=bool(args.bf16),
    )
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        values["hidden_size"] = hidden
    if num_training_steps is not None:
        values["num_training_steps"] = num_training_steps
        values["warmup_steps"] = args.get_warmup_steps(num_training_steps)
    return values


def describe(cfg, world_size: int) -> str:
    """One line: stage, offload and placement of a resolved zeroio config."""
    zc = cfg.zero_optimization
    opt, par = zc.offload_optimizer, zc.offload_param
    opt_dev, par_dev = _name(opt.device), _name(par.device)
    where = {"none": "gpu" if _cuda() else "the compute device"}
    opt_at = where.get(opt_dev, opt_dev) + (f" ({opt.nvme_path})" if opt_dev == "nvme" else "")
    if zc.stage == 3:
        par_at = "partitioned, " + where.get(par_dev, par_dev)
        par_at += f" ({par.nvme_path})" if par_dev == "nvme" else ""
    else:
        par_at = "replicated on every rank"
    return (f"zeroio: ZeRO stage {zc.stage} on {world_size} rank(s), {cfg.compute_dtype} compute; "
            f"offload_optimizer={opt_dev}, offload_param={par_dev}; optimizer state on {opt_at}; "
            f"parameters {par_at}; swap policy {_name(zc.tiering.policy)}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
