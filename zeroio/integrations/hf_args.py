"""zeroio's ``TrainingArguments``: ``deepspeed=`` is the zeroio config.

[Note: the deepspeed field]
transformers' ``TrainingArguments.__post_init__`` turns a truthy ``deepspeed``
into an ``HfTrainerDeepSpeedConfig`` and a DeepSpeed plugin (which import the
``deepspeed`` package), and ``_setup_devices`` / the Trainer look at it again
later. So the subclass moves the value to its own field ``zeroio_config``
before transformers' ``__post_init__`` runs and leaves ``deepspeed`` as None:
transformers' DeepSpeed code never runs, ``args.deepspeed`` reads None, and
``args.zeroio_config`` holds the path or dict as given. ``--deepspeed ds.json``
through ``HfArgumentParser(TrainingArguments)`` lands in the same field
(``--zeroio_config`` is accepted too; giving both is a ``ConfigError``).

[Note: stage 3 loads partitioned]
With DeepSpeed, creating TrainingArguments with a ZeRO-3 config makes every
later ``from_pretrained`` build the model inside ``deepspeed.zero.Init``:
``HfTrainerDeepSpeedConfig`` registers itself in a module-level weak
reference that ``is_deepspeed_zero3_enabled()`` reads, so the effect lasts as
long as the arguments object lives. zeroio keeps the same habit without
touching transformers' switch: a stage-3 ``TrainingArguments`` holds a
``_Zero3Scope``, a module-level weak reference points at the newest one, and
``PreTrainedModel.from_pretrained`` is wrapped (once, on the first stage-3
arguments) to run inside ``zeroio.zero.Init(config=...)`` while that scope
is alive. The wrapper is a pass-through otherwise: no arguments object, a
non-stage-3 one, a nested ``from_pretrained``, or after ``deactivate_zero3()``.
The config given to zero.Init is the user's, with the "auto" values that
TrainingArguments determine (batch sizes, precision, optimizer values)
filled; the bucket sizes stay "auto" for zero.Init to fill from the model.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import transformers

from zeroio.errors import ConfigError
from zeroio.integrations.accelerate import check_launch
from zeroio.integrations.autofill import fill_known_autos
from zeroio.integrations.hf_config import auto_values, read_config

_ACTIVE: weakref.ref | None = None
_LOCAL = threading.local()


class _Zero3Scope:
    """Held by a stage-3 ``TrainingArguments``; alive as long as the arguments are."""

    def __init__(self, args: TrainingArguments):
        self._args = weakref.ref(args)

    def init_config(self) -> dict[str, Any] | None:
        args = self._args()
        if args is None:
            return None
        return fill_known_autos(args.zeroio_raw, **auto_values(args))


def active_zero3_config() -> dict[str, Any] | None:
    """The config ``from_pretrained`` is partitioned with now, or None (see [Note: stage 3 ...])."""
    scope = _ACTIVE() if _ACTIVE is not None else None
    return None if scope is None else scope.init_config()


def deactivate_zero3() -> None:
    """Later ``from_pretrained`` calls load whole again (the arguments object stays valid)."""
    global _ACTIVE
    _ACTIVE = None


def _activate(scope: _Zero3Scope) -> None:
    global _ACTIVE
    _install_hook()
    _ACTIVE = weakref.ref(scope)


def _install_hook() -> None:
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"]
    if getattr(current.__func__, "_zeroio_hook", False):
        return
    original = current.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        config = None if getattr(_LOCAL, "inside", False) else active_zero3_config()
        if config is None:
            return original(cls, *args, **kwargs)
        import zeroio

        _LOCAL.inside = True
        try:
            with zeroio.zero.Init(config=config):
                return original(cls, *args, **kwargs)
        finally:
            _LOCAL.inside = False

    from_pretrained._zeroio_hook = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    _refuse_partitioned_resize(PreTrainedModel)


def _refuse_partitioned_resize(model_cls) -> None:
    """[Note: resizing a partitioned embedding] transformers resizes embeddings that zero.Init
    partitioned only on its own ZeRO-3 path (``is_deepspeed_zero3_enabled()``), which zeroio's
    classes leave off; its plain path would read an empty shard ("not enough values to
    unpack"). So a resize of such a model says what works instead."""
    original = model_cls.resize_token_embeddings
    if getattr(original, "_zeroio_hook", False):
        return

    @functools.wraps(original)
    def resize_token_embeddings(self, *args, **kwargs):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        from zeroio.partition.stage3.registry import INIT_SHARDS

        emb = self.get_input_embeddings()
        if emb is not None and emb.weight in INIT_SHARDS and not is_deepspeed_zero3_enabled():
            raise ConfigError(
                "resize_token_embeddings on a model zeroio's TrainingArguments loaded "
                "partitioned (stage 3): transformers resizes a partitioned embedding only on "
                "its own ZeRO-3 path. Use transformers' Trainer and TrainingArguments with "
                "`import zeroio.integrations.transformers` (the deepspeed facade: "
                "docs/transformers.md), or stage 1/2 with zeroio's classes",
                key="zero_optimization.stage")
        return original(self, *args, **kwargs)

    resize_token_embeddings._zeroio_hook = True
    model_cls.resize_token_embeddings = resize_token_embeddings


def _stage(raw: dict[str, Any]) -> Any:
    zo = raw.get("zero_optimization")
    return zo.get("stage", 0) if isinstance(zo, dict) else 0


def _cpu_world() -> int:
    """The launched world size on a machine with no accelerator, else 0.

    There, transformers without ``use_cpu`` makes each rank a world of its own
    (accelerate's state is single-process unless told ``cpu=True``), and the engine
    then refused a config resolved for 1 rank with 2 running. A zeroio run on such
    a machine can only train on CPU, so it does, as ``--use_cpu`` would."""
    import torch

    from zeroio.config.launch_env import launch_env

    acc = getattr(torch, "accelerator", None)
    if torch.cuda.is_available() or (acc is not None and acc.is_available()):
        return 0
    return launch_env().world_size or 0


_HELP = ("zeroio config (DeepSpeed JSON schema): a path to a JSON file or a dict; "
         '"auto" values are filled from these arguments')


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed`` is the zeroio config.

    See [Note: the deepspeed field] and [Note: stage 3 loads partitioned].
    """

    deepspeed: dict | str | None = field(default=None, metadata={"help": _HELP})
    zeroio_config: dict | str | None = field(
        default=None, metadata={"help": "the same as --deepspeed (give one of the two)"})

    def __post_init__(self):
        check_launch()
        if self.deepspeed and self.zeroio_config:
            raise ConfigError("TrainingArguments got both deepspeed= and zeroio_config=; they are "
                              "the same setting: give one", key="deepspeed")
        if self.deepspeed:
            self.zeroio_config = self.deepspeed
        self.deepspeed = None
        if self.zeroio_config and not self.use_cpu and _cpu_world() > 1:
            self.use_cpu = True  # see _cpu_world
        super().__post_init__()
        self.zeroio_raw = (read_config(self.zeroio_config, key="deepspeed")
                           if self.zeroio_config else None)
        self._zeroio_zero3 = None
        if self.zeroio_raw is not None and _stage(self.zeroio_raw) == 3:
            self._zeroio_zero3 = _Zero3Scope(self)
            _activate(self._zeroio_zero3)
