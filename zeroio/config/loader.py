"""``Config`` (the whole resolved config) and ``load_config``.

Loading is one pass, in this order: read JSON (UTF-8, no key repeated in an
object: ``read_config``) -> rewrite legacy shapes ->
fill "auto" -> build every section (types, ranges, unknown keys) -> complete
the batch triple -> cross-section checks. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from zeroio import jsonlimits
from zeroio.config import legacy, overrides
from zeroio.config.auto import BATCH_KEYS, check_auto_values, drop_unfillable, resolve_auto
from zeroio.config.batch import complete
from zeroio.config.fields import (
    as_bool,
    build,
    did_you_mean,
    float_coercer,
    int_coercer,
    optional,
    section,
    sub,
    to_jsonable,
)
from zeroio.config.fields import (
    field as cfg_field,
)
from zeroio.config.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler
from zeroio.config.sections import (
    AioConfig,
    BF16Config,
    CheckpointConfig,
    DistributedConfig,
    FP16Config,
    check_aio,
)
from zeroio.config.zero import (
    OffloadDevice,
    ZeroConfig,
    ineffective_tiering_keys,
    masters_place,
    params_from_master_enabled,
)
from zeroio.errors import ConfigError, ConfigWarning


@dataclass(frozen=True, kw_only=True)
class _Scalars:
    """Top-level scalar keys and simple sections, read by the generic builder."""

    train_batch_size: int | None = cfg_field(None, coerce=optional(int_coercer(gt=0)))
    train_micro_batch_size_per_gpu: int | None = cfg_field(None, coerce=optional(int_coercer(gt=0)))
    gradient_accumulation_steps: int | None = cfg_field(None, coerce=optional(int_coercer(gt=0)))
    gradient_clipping: float = cfg_field(0.0, coerce=float_coercer(ge=0))
    steps_per_print: int | None = cfg_field(None, coerce=optional(int_coercer(gt=0)))
    wall_clock_breakdown: bool = cfg_field(False, coerce=as_bool)
    zero_force_ds_cpu_optimizer: bool = cfg_field(True, coerce=as_bool)
    zero_optimization: ZeroConfig = sub(ZeroConfig)
    aio: AioConfig = sub(AioConfig)
    fp16: FP16Config = sub(FP16Config)
    bf16: BF16Config = sub(BF16Config)
    checkpoint: CheckpointConfig = sub(CheckpointConfig)
    distributed: DistributedConfig = sub(DistributedConfig)
    # optimizer/scheduler have their own builders (their params depend on type).
    optimizer: Any = cfg_field(None, coerce=lambda v, p: build_optimizer(v, p))
    scheduler: Any = cfg_field(None, coerce=lambda v, p: build_scheduler(v, p))


@dataclass(frozen=True, kw_only=True)
class Config:
    """A resolved zeroio / DeepSpeed config. Build it with ``load_config``.

    Attribute names are DeepSpeed's JSON names after alias resolution; every
    value is checked and complete (no "auto", no None where a value is needed
    except the documented "derived at runtime" budgets and steps_per_print).
    """

    train_batch_size: int
    """Samples per optimizer step over all ranks = micro x accumulation x world_size."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    steps_per_print: int | None = None
    """Log every N steps; None never logs periodically (DeepSpeed 0.19's default)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately and report them."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require zeroio's CPU optimizer (reject a client GPU optimizer)."""
    world_size: int = 1
    """Data-parallel ranks: load_config(world_size=...), else $WORLD_SIZE, else 1."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """zeroio's process-group settings: ``timeout_s`` of every collective."""
    unimplemented: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), metadata={"json": False})
    """DeepSpeed keys present in the file that zeroio accepts but does not implement
    (key path -> value as written); see docs/config.md."""
    env_overrides: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), metadata={"json": False})
    """The ``ZEROIO_*`` environment overrides set when the config was loaded (variable ->
    ``{"value", "key"}``; config/overrides.py). A key override's value is already in its key."""

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def compute_dtype(self) -> str:
        """ "fp16", "bf16" or "fp32": the dtype of parameters and gradients."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a JSON-able dict; load_config(d, world_size=...) rebuilds it."""
        out = to_jsonable(self)
        out.pop("world_size")
        if self.env_overrides:  # informational: load_config drops it (the keys hold the values)
            out[ENV_OVERRIDES_KEY] = {k: dict(v) for k, v in self.env_overrides.items()}
        return out


ENV_OVERRIDES_KEY = "env_overrides"
"""``Config.to_dict()``'s record of the environment overrides; accepted and dropped on load."""


class _Object(dict):
    """A JSON object as parsed, with the keys it held more than once (``repeated``)."""

    __slots__ = ("repeated",)


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    obj.repeated = []
    for key, value in pairs:
        if key in obj:
            obj.repeated.append((key, obj[key], value))
        obj[key] = value
    return obj


def _plain(value: Any, path: Path, at: str) -> Any:
    """``value`` with plain dicts for ``_Object``s; ConfigError at the first repeated key."""
    if isinstance(value, _Object):
        if value.repeated:
            key, first, again = value.repeated[0]
            where = f"{at}.{key}" if at else key
            raise ConfigError(
                f"config file {path}: key {where} appears twice in one JSON object (values "
                f"{json.dumps(first)} and {json.dumps(again)}); DeepSpeed rejects duplicate keys, "
                "keep one of them", key=where)
        return {k: _plain(v, path, f"{at}.{k}" if at else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, path, f"{at}[{i}]") for i, v in enumerate(value)]
    return value


def read_config(path_or_dict: Any) -> dict[str, Any]:
    """The raw JSON object of a config file (or a copy of a dict), before any check.

    A file must be UTF-8 JSON holding one object with no key repeated within an
    object; anything else is a ConfigError naming the file (and the byte offset of
    the first undecodable byte, or the key path of the repeated key).
    """
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if isinstance(path_or_dict, (str, os.PathLike)):
        path = Path(path_or_dict)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist", key=None) from None
        except (OSError, ValueError) as e:  # ValueError: NUL in the path
            raise ConfigError(f"cannot read config file {str(path)!r}: {e}", key=None) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not UTF-8 text: byte {e.start} (0x{data[e.start]:02x}) "
                f"is not valid UTF-8 ({e.reason}); save the file as UTF-8", key=None) from None
        try:
            parsed = jsonlimits.loads(text, f"config file {path}", object_pairs_hook=_pairs)
        except jsonlimits.JSONLimitError as e:
            raise ConfigError(f"{e}; pass a DeepSpeed config file", key=None) from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}", key=None) from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"config file {path} must hold a JSON object, not "
                              f"{type(parsed).__name__}", key=None)
        return _plain(parsed, path, "")
    raise ConfigError(f"config must be a path or a dict, not {type(path_or_dict).__name__}",
                      key=None)


def _world_size(values: dict[str, Any]) -> int:
    if "world_size" in values:
        return values["world_size"]
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1
    try:
        ws = int(env)
    except ValueError:
        ws = 0
    if ws < 1:
        raise ConfigError(f"environment WORLD_SIZE={env!r}: expected a positive integer",
                          key="world_size")
    return ws


def _check_offload(cfg: Config) -> None:
    zero = cfg.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        block = getattr(zero, name)
        key = f"zero_optimization.{name}"
        if block.device is OffloadDevice.NVME and block.nvme_path is None:
            raise ConfigError(f'{key}.device is "nvme" but {key}.nvme_path is not set: give '
                              "a directory on the NVMe drive", key=f"{key}.nvme_path")
    if zero.offload_param.device is not OffloadDevice.NONE and zero.stage != 3:
        raise ConfigError(
            f'zero_optimization.offload_param.device = "{zero.offload_param.device.value}" '
            f"needs zero_optimization.stage 3 (stage is {zero.stage}): only stage 3 "
            "partitions parameters", key="zero_optimization.offload_param.device")
    ratio = zero.offload_optimizer.ratio
    if ratio < 1.0 and zero.stage == 0:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio = {ratio:g} needs "
            "zero_optimization.stage 1, 2 or 3 (stage is 0): a partial optimizer offload "
            "splits this rank's optimizer shard; set ratio 1.0 or a stage >= 1",
            key="zero_optimization.offload_optimizer.ratio")
    if ratio < 1.0 and zero.stage in (1, 2) and \
            zero.offload_optimizer.device is OffloadDevice.NVME:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio = {ratio:g} with "
            f'offload_optimizer.device "nvme" needs zero_optimization.stage 3 (stage is '
            f'{zero.stage}): at stages 1 and 2 a partial offload is to "cpu" only; set '
            'offload_optimizer.device "cpu", ratio 1.0, or stage 3',
            key="zero_optimization.offload_optimizer.ratio")
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one",
                          key="bf16.enabled")
    _check_bf16_state(cfg)
    check_aio(cfg.aio)
    params_from_master_enabled(zero)  # a ConfigError where it cannot apply
    masters_place(zero)  # likewise


def _check_bf16_state(cfg: Config) -> None:
    """DeepSpeed's rules for ``bf16.bf16_master_weights_and_grads`` and
    ``bf16.bf16_optimizer_states`` (runtime/config.py, base_optimizer.py), plus zeroio's own
    limit (no partial offload); docs/engine.md, "bf16 optimizer state"."""
    b, zero = cfg.bf16, cfg.zero_optimization
    on = [k for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states")
          if getattr(b, k)]
    if not on:
        return
    key = f"bf16.{on[-1]}"
    if not b.enabled:
        raise ConfigError(f"{key} = true needs bf16.enabled = true (bf16 parameters and "
                          "gradients); enable bf16 or drop the key", key=key)
    if zero.stage == 0:
        raise ConfigError(f"{key} = true needs zero_optimization.stage 1, 2 or 3 (stage is 0): "
                          "the bf16 state is the ZeRO optimizer's", key=key)
    if b.bf16_optimizer_states and not b.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states = true needs "
                          "bf16.bf16_master_weights_and_grads = true (as in DeepSpeed: bf16 "
                          "moments go with bf16 master weights); set both",
                          key="bf16.bf16_optimizer_states")
    offload = zero.offload_optimizer.device
    if not b.bf16_optimizer_states and offload is OffloadDevice.NONE:
        raise ConfigError("bf16.bf16_master_weights_and_grads = true with fp32 optimizer states "
                          "needs zero_optimization.offload_optimizer.device \"cpu\" or \"nvme\" "
                          "(as in DeepSpeed: the fp32 moments live off the GPU); offload the "
                          "optimizer, or set bf16.bf16_optimizer_states = true too",
                          key="bf16.bf16_master_weights_and_grads")
    if offload is not OffloadDevice.NONE and zero.offload_optimizer.ratio < 1.0:
        raise ConfigError(f"{key} = true with zero_optimization.offload_optimizer.ratio = "
                          f"{zero.offload_optimizer.ratio:g}: zeroio's partial offload keeps "
                          "fp32 state on the GPU side; set ratio 1.0 or drop the key", key=key)


def load_config(path_or_dict: Any, **auto_values: Any) -> Config:
    """Read a DeepSpeed JSON config (path or dict) into a checked, complete ``Config``.

    A ``Config`` passed in is returned as is (or rebuilt, when auto_values are given).

    ``auto_values`` fill "auto" entries and the world size: world_size,
    hidden_size and the Hugging Face TrainingArguments names
    (per_device_train_batch_size, gradient_accumulation_steps, learning_rate,
    adam_beta1, adam_beta2, adam_epsilon, weight_decay, max_grad_norm, fp16,
    bf16, num_training_steps, warmup_steps). Every problem is a ConfigError
    naming the key path.
    """
    if isinstance(path_or_dict, Config):
        if not auto_values:
            return path_or_dict
        auto_values.setdefault("world_size", path_or_dict.world_size)
        path_or_dict = path_or_dict.to_dict()
    values = check_auto_values(auto_values)
    raw = legacy.rewrite(read_config(path_or_dict))
    raw.pop(ENV_OVERRIDES_KEY, None)
    raw, env_overrides = overrides.apply(raw)
    world_size = _world_size(values)
    raw, unfilled = resolve_auto(raw, values)
    token = legacy._seen.set({})
    try:
        scalars = build(_Scalars, raw, "")
        unimplemented = dict(legacy._seen.get() or {})
    finally:
        legacy._seen.reset(token)
    batch = complete({k: getattr(scalars, k) for k in BATCH_KEYS}, world_size, unfilled)
    zero = scalars.zero_optimization
    if zero.overlap_comm is None:
        zero = replace(zero, overlap_comm=zero.stage == 3)
    cfg = Config(
        train_batch_size=batch.train_batch_size,
        train_micro_batch_size_per_gpu=batch.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        gradient_clipping=scalars.gradient_clipping,
        steps_per_print=scalars.steps_per_print,
        wall_clock_breakdown=scalars.wall_clock_breakdown,
        zero_force_ds_cpu_optimizer=scalars.zero_force_ds_cpu_optimizer,
        world_size=world_size,
        zero_optimization=zero,
        aio=scalars.aio,
        fp16=scalars.fp16,
        bf16=scalars.bf16,
        optimizer=scalars.optimizer,
        scheduler=scalars.scheduler,
        checkpoint=scalars.checkpoint,
        distributed=scalars.distributed,
        unimplemented=MappingProxyType(unimplemented),
        env_overrides=MappingProxyType(env_overrides),
    )
    _check_offload(cfg)
    _warn_ineffective(cfg, raw)
    return cfg


def collective_timeout(path_or_dict: Any) -> float:
    """``distributed.timeout_s`` of a config (path, dict or ``Config``), read before the rest
    is resolved: the process group is created before the world size is known."""
    if isinstance(path_or_dict, Config):
        return path_or_dict.distributed.timeout_s
    raw = legacy.rewrite(read_config(path_or_dict)) if path_or_dict is not None else {}
    block = raw.get("distributed")
    return build(DistributedConfig, {} if block is None else block, "distributed").timeout_s


INIT_SECTIONS = ("zero_optimization", "fp16", "bf16", "aio", "distributed")
"""The top-level keys ``zero.Init`` reads: partitioning needs the stage, the ZeRO block and
the 16-bit switches, nothing of the optimizer, scheduler or batch sizes."""


def load_init_config(path_or_dict: Any, **auto_values: Any) -> Config:
    """The config as ``zero.Init`` reads it: only ``INIT_SECTIONS``, and an "auto" in them
    that ``auto_values`` cannot fill takes the key's default instead of being an error.

    A config written for the Trainer (an "auto" learning rate, batch sizes,
    gradient clipping, a WarmupDecayLR whose ``total_num_steps`` is "auto") is
    read whole later, by the ``load_config`` of ``initialize`` or the Trainer,
    which fills those keys or rejects them; here they cannot matter. Without
    ``hidden_size`` the bucket and persistence "auto" keys take DeepSpeed's
    defaults (docs/stage3.md).
    """
    if isinstance(path_or_dict, Config):
        return path_or_dict
    values = check_auto_values(auto_values)
    raw = legacy.rewrite(read_config(path_or_dict))
    raw = {k: v for k, v in raw.items() if k in INIT_SECTIONS}
    raw, _ = drop_unfillable(raw, values)
    return load_config(raw, **auto_values)


def _warn_ineffective(cfg: Config, raw: Any) -> None:
    """One ``ConfigWarning`` per key that can have no effect in this config."""
    zero_raw = raw.get("zero_optimization") if isinstance(raw, dict) else None
    tiering = zero_raw.get("tiering") if isinstance(zero_raw, dict) else None
    for key, why in ineffective_tiering_keys(cfg.zero_optimization, tiering):
        warnings.warn(ConfigWarning(f"{key} has no effect: {why}"), stacklevel=3)


__all__ = ["Config", "INIT_SECTIONS", "load_config", "load_init_config", "read_config", "collective_timeout",
           "did_you_mean", "section"]
