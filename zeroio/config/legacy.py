"""DeepSpeed's legacy spellings, and the DeepSpeed keys zeroio does not implement.

Field-level aliases (``thread_count`` -> ``intra_op_parallelism``,
``stage3_gather_fp16_weights_on_model_save`` -> ...) live on the fields
themselves. This module handles the rewrites that change the shape of the
config (``cpu_offload: true`` becomes an ``offload_optimizer`` block) and the
policy for keys DeepSpeed has and zeroio does not:

[Note: unimplemented DeepSpeed keys]
- SEMANTIC keys change what is trained or stored (quantized weights, MiCS,
  communication dtype, ...). They are accepted only at DeepSpeed's default
  value, which is what zeroio does anyway; any other value is a ConfigError
  saying zeroio does not implement it.
- TOLERATED keys tune speed or diagnostics only (monitors, profilers,
  bucket-allreduce tricks). Any well-formed value is accepted; a non-default
  value emits a ``ConfigWarning`` naming the key, because it has no effect.
Both kinds are listed, with their values, in ``Config.unimplemented``: no key
is dropped without a trace. A "block" default (``OFF``) means a section with
an ``enabled`` switch: absent, null or ``{"enabled": false, ...}`` is default.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Mapping
from typing import Any

from zeroio.config.fields import AUTO, join, show
from zeroio.errors import ConfigError


class ConfigWarning(UserWarning):
    """A DeepSpeed key was given a value that has no effect in zeroio."""


OFF = object()  # default of a block with an "enabled" switch

SEMANTIC: dict[str, Any] = {
    # top level
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    "sequence_parallel_size": 1,
    "disable_allgather": False,
    "dataloader_drop_last": False,
    "use_data_before_expert_parallelism": False,
    "gradient_allreduce_op": "mean",
    "managed_gradient_accumulation": True,
    "amp": OFF,
    "torch_autocast": OFF,
    "elasticity": OFF,
    "data_efficiency": OFF,
    "curriculum_learning": OFF,
    "progressive_layer_drop": OFF,
    "eigenvalue": OFF,
    "hybrid_engine": OFF,
    "compression_training": None,
    "sparse_attention": None,
    "weight_quantization": None,
    "tensor_parallel": None,
    "data_types": {"grad_accum_dtype": None},
    # zero_optimization
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.parameter_alignment": False,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.zeropp_loco_param": None,
    "zero_optimization.mics_shard_size": -1,
    "zero_optimization.mics_hierarchical_params_gather": False,
    "zero_optimization.zenflow": None,
    "zero_optimization.stage3_partition_stream_chunk_size": 0,
    "zero_optimization.partition_stream_chunk_size": 0,
    "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.save_muon_momentum_buffer_in_memory": False,
    "zero_optimization.leaf_module": None,
    "zero_optimization.offload_optimizer.super_offload": False,
    # precision
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.check_grad_overflow": False,
    "checkpoint.writer": None,
}

TOLERATED: dict[str, Any] = {
    # monitors, profilers and debugging aids
    "tensorboard": OFF,
    "wandb": OFF,
    "csv_monitor": OFF,
    "comet": OFF,
    "comms_logger": OFF,
    "flops_profiler": OFF,
    "autotuning": OFF,
    "compile": None,
    "activation_checkpointing": None,
    "pipeline": None,
    "timers": None,
    "nebula": OFF,
    "dump_state": False,
    "memory_breakdown": False,
    "graph_harvesting": False,
    "vocabulary_size": None,
    "zero_allow_untested_optimizer": False,
    # zero_optimization speed knobs
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.enable_sanity_checks": False,
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.stage3_model_persistence_threshold": None,
    "zero_optimization.model_persistence_threshold": None,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_allgather_sequential": False,
    "zero_optimization.allgather_sequential": False,
    "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": True,
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8,
    "fp16.fused_mode": True,
    "bf16.immediate_grad_update": False,
}

# Keys seen during one load_config call: key path -> value as written.
_seen: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "zeroio_config_unimplemented", default=None)


def is_unimplemented(key_path: str) -> bool:
    return key_path in SEMANTIC or key_path in TOLERATED


def unimplemented_names(section_path: str) -> list[str]:
    prefix = f"{section_path}." if section_path else ""
    names = []
    for key in (*SEMANTIC, *TOLERATED):
        if key.startswith(prefix) and "." not in key[len(prefix):]:
            names.append(key[len(prefix):])
    return names


def _is_default(value: Any, default: Any) -> bool:
    if default is OFF:
        return value is None or (isinstance(value, Mapping) and value.get("enabled", False) is False)
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def check_unimplemented(key_path: str, value: Any) -> None:
    """Apply the policy of the note above to one key; record it."""
    seen = _seen.get()
    if seen is not None:
        seen[key_path] = value
    if key_path in SEMANTIC:
        default = SEMANTIC[key_path]
        if not _is_default(value, default):
            expected = ('absent or {"enabled": false}' if default is OFF
                        else f"absent or {show(default)} (DeepSpeed's default)")
            raise ConfigError(
                f"{key_path} = {show(value)}: zeroio does not implement this DeepSpeed "
                f"option; expected {expected}", key=key_path)
    elif not _is_default(value, TOLERATED[key_path]):
        warnings.warn(f"{key_path} = {show(value)} has no effect in zeroio (DeepSpeed "
                      "speed/diagnostic option it does not implement)", ConfigWarning,
                      stacklevel=4)


def rewrite(raw: dict[str, Any]) -> dict[str, Any]:
    """Turn DeepSpeed's shape-changing legacy spellings into current ones (a copy)."""
    out = dict(raw)
    if "bfloat16" in out:
        if "bf16" in out and out["bf16"] != out["bfloat16"]:
            raise ConfigError('both "bf16" and its legacy name "bfloat16" are set, to '
                              "different values: keep bf16", key="bfloat16")
        out["bf16"] = out.pop("bfloat16")
    zero = out.get("zero_optimization")
    if isinstance(zero, bool):
        # DeepSpeed's oldest form: a bare switch for stage 1, bucket size at top level.
        zero = {"stage": 1 if zero else 0}
        if "allgather_size" in out:
            zero["allgather_bucket_size"] = out.pop("allgather_size")
        out["zero_optimization"] = zero
    if isinstance(zero, Mapping):
        out["zero_optimization"] = _rewrite_zero(dict(zero))
    return out


def _legacy_offload(zero: dict, old: str, new: str, pin: Any) -> None:
    path = join("zero_optimization", old)
    value = zero.pop(old)
    if value == AUTO or not isinstance(value, bool):
        raise ConfigError(f"{path} = {show(value)}: expected true or false "
                          f"(deprecated; prefer {join('zero_optimization', new)})", key=path)
    if not value:
        return
    if zero.get(new) is not None:
        raise ConfigError(f"{path} = true and zero_optimization.{new} are both set: keep "
                          f"zero_optimization.{new} only", key=path)
    block: dict[str, Any] = {"device": "cpu"}
    if pin is not None:
        block["pin_memory"] = pin
    zero[new] = block


def _rewrite_zero(zero: dict[str, Any]) -> dict[str, Any]:
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if pin is not None and not isinstance(pin, bool):
        raise ConfigError(f"zero_optimization.cpu_offload_use_pin_memory = {show(pin)}: "
                          "expected true or false", key="zero_optimization.cpu_offload_use_pin_memory")
    if "cpu_offload" in zero:
        _legacy_offload(zero, "cpu_offload", "offload_optimizer", pin)
    if "cpu_offload_param" in zero:
        _legacy_offload(zero, "cpu_offload_param", "offload_param", pin)
    return zero
