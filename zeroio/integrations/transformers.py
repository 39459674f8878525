"""Hugging Face Trainer on a zeroio engine: ``ZeroIOTrainer``.

The change to a Trainer script is as small as DeepSpeed's ``TrainingArguments(
deepspeed="ds.json")``: import ``ZeroIOTrainer`` instead of ``Trainer`` and pass
the config beside the arguments::

    from zeroio.integrations.transformers import ZeroIOTrainer
    trainer = ZeroIOTrainer(model=model, args=TrainingArguments(...),
                            train_dataset=..., eval_dataset=...,
                            zeroio_config="configs/zero3-nvme.json")

Written against transformers 5.x (the Trainer whose loop is split into
``_prepare_for_training`` / ``_run_epoch``); it overrides the same hooks
transformers' own DeepSpeed branches sit in.

[Note: who steps] As with DeepSpeed, the engine owns backward, gradient
accumulation, clipping, the optimizer and the LR schedule: ``training_step``
calls ``engine.backward`` and ``engine.step`` on every micro-batch (the engine
steps at its accumulation boundary). The Trainer still calls
``optimizer.step()`` / ``lr_scheduler.step()`` at its sync points; those are
no-ops on the proxies below, which only report the engine's learning rate.
Trainer-side gradient clipping is replaced by the engine's
``gradient_clipping`` (filled from ``max_grad_norm``).

[Note: auto and contradictions] "auto" keys are filled from TrainingArguments
by ``zeroio.load_config`` (the same table as transformers' DeepSpeed
integration); a key given explicitly with a different value is a
``ConfigError`` listing every such key, checked once at construction and again,
with the step counts, when the engine is built. A config without an
``optimizer`` block gets AdamW with every value "auto"; without a ``scheduler``
block, TrainingArguments' ``lr_scheduler_type`` is mapped (linear ->
WarmupDecayLR, constant[_with_warmup] -> WarmupLR).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

from zeroio.errors import CheckpointError, ConfigError
from zeroio.integrations.autofill import check_no_contradictions

logger = logging.get_logger(__name__)

_SCHEDULERS = {
    "linear": ("WarmupDecayLR", {"total_num_steps": "auto"}),
    "constant_with_warmup": ("WarmupLR", {}),
    "constant": ("WarmupLR", {}),
}


def _read_config(config: str | os.PathLike | dict) -> dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"zeroio_config {path} does not exist", key="zeroio_config")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"zeroio_config {path} is not valid JSON: {e}", key="zeroio_config") from e


def _scheduler_type(args) -> str:
    value = args.lr_scheduler_type
    return getattr(value, "value", value)


def complete_config(raw: dict[str, Any], args) -> dict[str, Any]:
    """``raw`` with an all-"auto" AdamW and a scheduler from ``lr_scheduler_type`` where absent."""
    out = copy.deepcopy(raw)
    out.setdefault("optimizer", {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}})
    if "scheduler" not in out:
        kind = _scheduler_type(args)
        if kind not in _SCHEDULERS:
            raise ConfigError(
                f"TrainingArguments lr_scheduler_type={kind!r} has no zeroio equivalent; use one of "
                f"{', '.join(_SCHEDULERS)} or put a \"scheduler\" block in the zeroio config",
                key="scheduler")
        name, extra = _SCHEDULERS[kind]
        warmup = 0 if kind == "constant" else "auto"
        out["scheduler"] = {"type": name, "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": warmup,
            "warmup_type": "linear", **extra}}
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


class _EngineModule(torch.nn.Module):
    """What the Trainer calls "the wrapped model": forward, train/eval through the engine."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module  # registered, so .parameters() and unwrap see the model
        self._engine = engine

    def forward(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def train(self, mode: bool = True):
        self.training = mode
        self._engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradient shards after each step (see [Note: who steps])."""


class _EngineOptimizer:
    """The Trainer's ``optimizer``: stepping is the engine's, so ``step``/``zero_grad`` do nothing."""

    def __init__(self, engine):
        self._engine = engine

    @property
    def param_groups(self):
        return self._engine.optimizer.param_groups

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {}


class _EngineScheduler:
    """The Trainer's ``lr_scheduler``: the engine steps its schedule; this reports the LR."""

    def __init__(self, engine):
        self._engine = engine

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def state_dict(self) -> dict:
        return {}


class ZeroIOTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through ``zeroio.initialize``.

    ``zeroio_config``: a DeepSpeed-schema config (path or dict); "auto" keys are
    filled from ``args`` (see [Note: auto and contradictions]).
    """

    def __init__(self, *args, zeroio_config: str | os.PathLike | dict, **kwargs):
        self._zeroio_raw = _read_config(zeroio_config)
        self.zeroio_engine = None
        self._zeroio_module = None
        super().__init__(*args, **kwargs)
        targs = self.args
        if getattr(targs, "deepspeed", None):
            raise ConfigError("pass either TrainingArguments(deepspeed=...) or zeroio_config=..., "
                              "not both", key="deepspeed")
        if targs.save_only_model and targs.load_best_model_at_end:
            raise ConfigError(
                "save_only_model=True with load_best_model_at_end=True is not supported by "
                "zeroio: the best model is reloaded from its sharded engine checkpoint, which "
                "save_only_model skips; drop one of the two", key="save_only_model")
        self._zeroio_raw = complete_config(self._zeroio_raw, targs)
        check_no_contradictions(self._zeroio_raw, "TrainingArguments",
                                **auto_values(targs, self.model))

    # ---- engine ---------------------------------------------------------------------------

    def _zeroio_setup(self, num_training_steps: int) -> None:
        if self.zeroio_engine is not None:
            return
        import zeroio

        values = auto_values(self.args, self.model, max(int(num_training_steps), 0))
        check_no_contradictions(self._zeroio_raw, "TrainingArguments", **values)
        raw = copy.deepcopy(self._zeroio_raw)
        if not values["num_training_steps"]:  # evaluation only: a schedule needs >= 1 step
            raw.get("scheduler", {}).get("params", {}).pop("total_num_steps", None)
            raw.pop("scheduler", None)
        cfg = zeroio.load_config(raw, **values)
        engine, _, _, _ = zeroio.initialize(model=self.model, config=cfg)
        self.zeroio_engine = engine
        self._zeroio_module = _EngineModule(engine)
        self.optimizer = _EngineOptimizer(engine)
        self.lr_scheduler = _EngineScheduler(engine)

    def create_optimizer(self, model=None):
        self._zeroio_setup(self.state.max_steps)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        self._zeroio_setup(num_training_steps)
        self.lr_scheduler = _EngineScheduler(self.zeroio_engine)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        self._zeroio_setup(self.state.max_steps if training else 0)
        return self._zeroio_module

    # ---- step (see [Note: who steps]) -----------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            # per-micro-batch mean loss: the engine itself averages over accumulation
            loss = self.compute_loss(model, inputs)
        del inputs
        self.zeroio_engine.backward(loss)
        self.zeroio_engine.step()
        return loss.detach() / self.args.gradient_accumulation_steps

    def _clip_grad_norm(self, model):
        return self.zeroio_engine.last_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return self.zeroio_engine.last_grad_norm if grad_norm is None else grad_norm

    # ---- saving and loading ---------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a ``from_pretrained`` folder (config + safetensors) from the engine's parameters.

        Every rank must call it (stage 3 gathers the weights). At stage 3 without
        ``stage3_gather_16bit_weights_on_model_save`` the user's own call raises
        ``CheckpointError`` (naming the fix); the Trainer's periodic checkpoints
        then keep only the sharded engine checkpoint, as DeepSpeed's do.
        """
        output_dir = output_dir or self.args.output_dir
        engine = self.zeroio_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        os.makedirs(output_dir, exist_ok=True)
        try:
            engine.save_16bit_model(output_dir)
        except CheckpointError as e:
            if not _internal_call:
                raise
            logger.warning("%s; this checkpoint keeps only the sharded engine state", e)
            return
        if self.args.should_save:
            self._save_model_metadata(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_model_metadata(self, output_dir: str) -> None:
        model = self.model
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        Path(output_dir, "training_args.json").write_text(self.args.to_json_string())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zeroio_engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self.zeroio_engine.load_checkpoint(checkpoint)

    def _save_rng_state(self, output_dir: str) -> None:
        """Not written: transformers pickles RNG states (torch.save), which zeroio never does."""

    def _load_rng_state(self, checkpoint) -> None:
        """Nothing to load (see ``_save_rng_state``)."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Weights come back with the engine checkpoint in ``_load_optimizer_and_scheduler``."""

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        path, _ = self.zeroio_engine.load_checkpoint(
            best, load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise ConfigError(f"load_best_model_at_end: no zeroio checkpoint in {best}",
                              key="load_best_model_at_end")
