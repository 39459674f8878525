"""``DeepSpeedEngine``: a zeroio ``Engine`` seen through DeepSpeed's engine interface.

transformers' Trainer, accelerate and TRL hold the object ``deepspeed.initialize``
returns and call DeepSpeed's engine methods on it (the list below is the
surveyed set); they also test ``isinstance(model, DeepSpeedEngine)`` to unwrap
it, and DeepSpeed's engine is an ``nn.Module``, so this adapter is one too
(``module`` is registered: ``.parameters()`` and unwrapping see the model).
Anything not listed falls through to the zeroio engine.

[Note: the accumulation boundary under accelerate]
accelerate calls ``set_gradient_accumulation_boundary(sync)`` and ``backward``
on every micro-batch but ``step()`` only when ``sync`` is true. zeroio's
engine counts micro-steps in ``step()`` (as DeepSpeed's does), so after a
backward that accelerate marked as not a boundary the adapter calls the
engine's ``step()`` itself, which then only counts the micro-step. A plain
DeepSpeed loop (``backward`` then ``step`` every micro-batch, no boundary
calls) is passed through unchanged. The boundary accelerate sets is forced on the
engine (as DeepSpeed's ``set_gradient_accumulation_boundary`` does): the last,
shorter accumulation of an epoch steps after fewer micro-batches. Trainer divides the loss by the
accumulation steps itself and says ``scale_wrt_gas=False``; the engine divides
again, so the adapter multiplies it back first.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from zeroio.config.launch_env import launch_env
from zeroio.deepspeed import accessors
from zeroio.deepspeed.client_state import decode, encode
from zeroio.deepspeed.engine_queries import EngineQueries
from zeroio.deepspeed.state_dict import consolidated_state_dict

logger = logging.getLogger("zeroio.deepspeed")


class ParamGroupsView(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` sharing a zeroio optimizer's ``param_groups`` dicts.

    torch's LR schedulers accept only ``Optimizer`` instances; transformers builds
    its schedule (``lr_scheduler_type``) with a factory taking the optimizer. Given
    this view, the schedule writes ``lr`` into the dicts zeroio's optimizer reads.
    """

    def __init__(self, optimizer):  # no super().__init__: the groups are the engine's
        self.param_groups = optimizer.param_groups
        self.defaults = {}
        self.state = {}
        self._zeroio_optimizer = optimizer

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _counter(name: str) -> property:
    """A counter of the zeroio engine, read and written through (``engine.global_steps = n``
    changes the engine's, as on DeepSpeed's)."""
    return property(lambda self: getattr(self.zeroio_engine, name),
                    lambda self, value: setattr(self.zeroio_engine, name, value),
                    doc=f"The zeroio engine's ``{name}``.")


def scheduler_factory(factory):
    """DeepSpeed's ``lr_scheduler=callable(optimizer)``, given a view torch accepts."""
    return lambda optimizer: factory(ParamGroupsView(optimizer))


class DeepSpeedEngine(EngineQueries, torch.nn.Module):
    """DeepSpeed's engine interface over a zeroio ``Engine`` (see the module docstring)."""

    def __init__(self, engine, config: dict | None = None):
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "zeroio_engine", engine)
        object.__setattr__(self, "_ds_config", dict(config or {}))
        self._boundary: bool | None = None
        self._warn_sharded_save = False
        accessors.register(engine)  # deepspeed.utils.safe_get_full_* find the engine

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "zeroio_engine"), name)

    # ---- what DeepSpeed's engine exposes -------------------------------------------------

    @property
    def config(self) -> dict:
        """The config dict as given to ``initialize`` (DeepSpeed's ``engine.config``)."""
        return self._ds_config

    @property
    def optimizer(self):
        return self.zeroio_engine.optimizer

    @property
    def lr_scheduler(self):
        return self.zeroio_engine.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value) -> None:
        """Lightning sets it to None to step the schedule itself: the engine then does not."""
        self.zeroio_engine.lr_scheduler = value

    @property
    def training_dataloader(self):
        return self.zeroio_engine.training_dataloader

    @property
    def client_optimizer(self):
        return self.zeroio_engine.client_optimizer

    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")

    @property
    def global_rank(self) -> int:
        return self.zeroio_engine.global_rank

    @property
    def world_size(self) -> int:
        return self.zeroio_engine.world_size

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks: every rank on zeroio."""
        return self.zeroio_engine.world_size

    @property
    def local_rank(self) -> int:
        return launch_env().local_rank

    @property
    def device(self) -> torch.device:
        return self.zeroio_engine.device

    def forward(self, *args, **kwargs):
        return self.zeroio_engine(*args, **kwargs)

    def train(self, mode: bool = True):
        self.training = mode
        self.zeroio_engine.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        zo = self.zeroio_engine.config.zero_optimization
        gather = bool(zo.stage3_gather_16bit_weights_on_model_save)
        self._warn_sharded_save = zo.stage == 3 and not gather
        return gather

    def get_global_grad_norm(self):
        return self.zeroio_engine.last_grad_norm

    def get_lr(self) -> list[float]:
        return self.zeroio_engine.get_lr()

    def was_step_applied(self) -> bool:
        return self.zeroio_engine.was_step_applied()

    def zero_grad(self) -> None:
        """Gradients are cleared after every optimizer step (kept for DeepSpeed-style loops)."""

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False):
        """The module's ``state_dict()`` (at stage 3 the parameters are this rank's shards, as
        in DeepSpeed; ``_zero3_consolidated_16bit_state_dict`` gathers them)."""
        out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    out.pop(prefix + name, None)
        return out

    def destroy(self) -> None:
        """DeepSpeed's teardown: zeroio stops the engine's threads and removes its swap
        folders (``Engine.close``)."""
        self.zeroio_engine.close()

    # ---- the step (see [Note: the accumulation boundary under accelerate]) ---------------

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)
        self.zeroio_engine.set_gradient_accumulation_boundary(self._boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.zeroio_engine.is_gradient_accumulation_boundary()

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        if not scale_wrt_gas:
            loss = loss * self.gradient_accumulation_steps()
        out = self.zeroio_engine.backward(loss)
        if self._boundary is False:
            self.zeroio_engine.step()
            self._boundary = None
        return out

    def step(self, lr_kwargs: dict | None = None) -> None:
        self._boundary = None
        self.zeroio_engine.step(lr_kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    # ---- saving and loading --------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        out = self.zeroio_engine.save_checkpoint(save_dir, tag, encode(client_state or {}))
        if self._warn_sharded_save:
            self._warn_sharded_save = False
            logger.warning(
                "stage3_gather_16bit_weights_on_model_save is false: %s holds the sharded zeroio "
                "checkpoint, not model weights; write them with `zeroio consolidate %s %s/model`",
                save_dir, save_dir, save_dir)
        return out

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        path, client_state = self.zeroio_engine.load_checkpoint(
            load_dir, tag, load_optimizer_states and not load_module_only,
            load_lr_scheduler_states and not load_module_only)
        return path, decode(client_state)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        self.zeroio_engine.save_16bit_model(save_dir)
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        return consolidated_state_dict(self.module, self.zeroio_engine.global_rank,
                                       exclude_frozen_parameters)


def as_deepspeed_engine(engine, config: dict | None) -> DeepSpeedEngine:
    """``engine`` seen as DeepSpeed's engine (unchanged if it already is one)."""
    return engine if isinstance(engine, DeepSpeedEngine) else DeepSpeedEngine(engine, config)
