"""Hugging Face Trainer on a zeroio engine: the drop-in ``Trainer`` and ``TrainingArguments``.

Importing this module also activates the ``deepspeed`` facade in this process
(zeroio/deepspeed/facade.py): transformers' own ``Trainer`` / ``TrainingArguments``
with ``deepspeed=`` then run on zeroio through transformers' DeepSpeed code paths
(ZeRO-3 loading, embedding resize, ``generate(synced_gpus=True)``), as under
``zeroio launch``. A real DeepSpeed installation is left alone.

A DeepSpeed-style Transformers script changes one line::

    from zeroio.integrations.transformers import Trainer, TrainingArguments

``TrainingArguments(deepspeed="ds.json" | dict)`` (or ``--deepspeed ds.json``
through ``HfArgumentParser(TrainingArguments)``) is then the zeroio config
(see zeroio/integrations/hf_args.py); without one, ``Trainer`` is the stock
Trainer. ``ZeroIOTrainer(..., zeroio_config=...)`` with transformers' own
TrainingArguments is the same class, given the config beside the arguments.

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
with the step counts, when the engine is built. ``optim`` and
``lr_scheduler_type`` are honoured or refused, never replaced: see [Note:
optim and lr_scheduler_type] in zeroio/integrations/hf_config.py.

The Trainer's ``disable_tqdm`` also silences zeroio's own progress bars (model
and checkpoint saves), and the engine's stage, offload and placement are
logged once, at info level, when the engine is built.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch
import transformers
from transformers.utils import logging

import zeroio.deepspeed  # noqa: F401  (activates the deepspeed facade: see above)
from zeroio.errors import CheckpointError, ConfigError
from zeroio.integrations.accelerate import check_launch
from zeroio.integrations.autofill import check_no_contradictions
from zeroio.integrations.hf_args import TrainingArguments, active_zero3_config, deactivate_zero3
from zeroio.integrations.hf_config import auto_values, complete_config, describe, read_config
from zeroio.io import progress
from zeroio.io.files import atomic_write_text

__all__ = ["Trainer", "TrainingArguments", "ZeroIOTrainer", "active_zero3_config",
           "deactivate_zero3"]

logger = logging.get_logger(__name__)
_trainer_log = logging.get_logger("transformers.trainer")  # the Trainer's own log


@contextlib.contextmanager
def _progress_bars(engine, show: bool):
    """zeroio's save bars (``engine.show_progress``) off while the Trainer's ``disable_tqdm``
    is set."""
    before = engine.show_progress
    engine.show_progress = before and show
    try:
        yield
    finally:
        engine.show_progress = before


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


def _config_source(args, zeroio_config):
    from_args = getattr(args, "zeroio_config", None)
    if getattr(args, "deepspeed", None):
        raise ConfigError("transformers.TrainingArguments(deepspeed=...) runs DeepSpeed, not zeroio: "
                          "import TrainingArguments from zeroio.integrations.transformers",
                          key="deepspeed")
    if from_args is not None and zeroio_config is not None:
        raise ConfigError("pass either TrainingArguments(deepspeed=...) or zeroio_config=..., "
                          "not both", key="deepspeed")
    if zeroio_config is not None:
        return read_config(zeroio_config)
    raw = getattr(args, "zeroio_raw", None)
    return copy.deepcopy(raw) if raw is not None else None


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains through ``zeroio.initialize`` when given a config.

    The config is ``args.zeroio_config`` (zeroio's ``TrainingArguments(deepspeed=...)``)
    or ``zeroio_config`` (path or dict); "auto" keys are filled from ``args``
    (see [Note: auto and contradictions]). Without either, the stock Trainer.
    """

    def __init__(self, *args, zeroio_config: str | os.PathLike | dict | None = None, **kwargs):
        check_launch()
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        self._zeroio_raw = _config_source(targs, zeroio_config) if targs is not None else (
            read_config(zeroio_config) if zeroio_config is not None else None)
        self.zeroio_engine = None
        self._zeroio_module = None
        super().__init__(*args, **kwargs)
        if self._zeroio_raw is None:
            return
        targs = self.args
        if targs.save_only_model and targs.load_best_model_at_end:
            raise ConfigError(
                "save_only_model=True with load_best_model_at_end=True is not supported by "
                "zeroio: the best model is reloaded from its sharded engine checkpoint, which "
                "save_only_model skips; drop one of the two", key="save_only_model")
        self._zeroio_raw = complete_config(self._zeroio_raw, targs)
        check_no_contradictions(self._zeroio_raw, "TrainingArguments",
                                **auto_values(targs, self.model))

    @property
    def _zeroio_on(self) -> bool:
        return self._zeroio_raw is not None

    # ---- engine ---------------------------------------------------------------------------

    def _zeroio_setup(self, num_training_steps: int) -> None:
        if self.zeroio_engine is not None:
            return
        import zeroio

        values = auto_values(self.args, self.model, max(int(num_training_steps), 0))
        check_no_contradictions(self._zeroio_raw, "TrainingArguments", **values)
        raw = copy.deepcopy(self._zeroio_raw)
        if not values["num_training_steps"]:  # evaluation only: a schedule needs >= 1 step
            raw.pop("scheduler", None)
        cfg = zeroio.load_config(raw, **values)
        with progress.quiet(self.args.disable_tqdm):  # initialize's bars too
            engine, _, _, _ = zeroio.initialize(model=self.model, config=cfg)
        self.zeroio_engine = engine
        self._zeroio_module = _EngineModule(engine)
        self.optimizer = _EngineOptimizer(engine)
        self.lr_scheduler = _EngineScheduler(engine)
        if self.is_world_process_zero():
            _trainer_log.info(describe(cfg, engine.world_size))

    def create_optimizer(self, model=None):
        if not self._zeroio_on:
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        self._zeroio_setup(self.state.max_steps)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if not self._zeroio_on:
            return super().create_scheduler(num_training_steps, optimizer)
        self._zeroio_setup(num_training_steps)
        self.lr_scheduler = _EngineScheduler(self.zeroio_engine)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not self._zeroio_on:
            return super()._wrap_model(model, training, dataloader)
        self._zeroio_setup(self.state.max_steps if training else 0)
        return self._zeroio_module

    # ---- step (see [Note: who steps]) -----------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._zeroio_on:
            return super().training_step(model, inputs, num_items_in_batch)
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
        if not self._zeroio_on:
            return super()._clip_grad_norm(model)
        return self.zeroio_engine.last_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        if not self._zeroio_on:
            return super()._get_grad_norm(model, grad_norm)
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
            if self._zeroio_on:  # not trained yet: build the engine so the saved model is its
                self._zeroio_setup(0)
                engine = self.zeroio_engine
            else:
                return super().save_model(output_dir, _internal_call)
        os.makedirs(output_dir, exist_ok=True)
        try:
            with _progress_bars(engine, not self.args.disable_tqdm):
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
        atomic_write_text(Path(output_dir, "training_args.json"), self.args.to_json_string())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._zeroio_on:
            return super()._save_optimizer_and_scheduler(output_dir)
        with _progress_bars(self.zeroio_engine, not self.args.disable_tqdm):
            self.zeroio_engine.save_checkpoint(output_dir,
                                               tag=f"global_step{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._zeroio_on:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.zeroio_engine.load_checkpoint(checkpoint)

    def _save_rng_state(self, output_dir: str) -> None:
        """Not written with zeroio: transformers pickles RNG states (torch.save)."""
        if not self._zeroio_on:
            return super()._save_rng_state(output_dir)

    def _load_rng_state(self, checkpoint) -> None:
        """Nothing to load with zeroio (see ``_save_rng_state``)."""
        if not self._zeroio_on:
            return super()._load_rng_state(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """With zeroio the weights come back with the engine checkpoint
        (``_load_optimizer_and_scheduler``)."""
        if not self._zeroio_on:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if not self._zeroio_on:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        path, _ = self.zeroio_engine.load_checkpoint(
            best, load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise ConfigError(f"load_best_model_at_end: no zeroio checkpoint in {best}",
                              key="load_best_model_at_end")


ZeroIOTrainer = Trainer
"""The same class under its earlier name (``ZeroIOTrainer(..., zeroio_config=...)``)."""
