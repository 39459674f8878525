"""The DeepSpeed configs of DeepSpeed's / transformers' Hugging Face integration docs,
written here from their documented keys and values ("auto" wherever the docs use it).

Each is a function of an NVMe folder (the NVMe examples need one) returning a fresh dict.
"""

from __future__ import annotations

from typing import Any

_FP16_AUTO = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
              "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}
_ADAMW_AUTO = {"type": "AdamW", "params": {
    "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
_WARMUP_LR_AUTO = {"type": "WarmupLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
_WARMUP_DECAY_AUTO = {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
    "total_num_steps": "auto"}}
_BATCH_AUTO = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
               "steps_per_print": 2000, "train_batch_size": "auto",
               "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def zero2(nvme: str) -> dict[str, Any]:
    return {"fp16": dict(_FP16_AUTO), "optimizer": _ADAMW_AUTO, "scheduler": _WARMUP_LR_AUTO,
            "zero_optimization": {
                "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "allgather_partitions": True, "allgather_bucket_size": 2e8,
                "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                "contiguous_gradients": True, "round_robin_gradients": True},
            **_BATCH_AUTO}


def zero3(nvme: str) -> dict[str, Any]:
    return {"fp16": dict(_FP16_AUTO), "optimizer": _ADAMW_AUTO, "scheduler": _WARMUP_LR_AUTO,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True},
            **_BATCH_AUTO}


def zero3_nvme(nvme: str) -> dict[str, Any]:
    cfg = zero3(nvme)
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
        "fast_init": False}
    cfg["zero_optimization"]["offload_param"] = {
        "device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 5,
        "buffer_size": 1e8, "max_in_cpu": 1e9}
    cfg["aio"] = {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
                  "single_submit": False, "overlap_events": True}
    return cfg


def zero3_decay_bf16(nvme: str) -> dict[str, Any]:
    """bf16 instead of fp16, WarmupDecayLR whose total_num_steps is "auto"."""
    cfg = zero3(nvme)
    del cfg["fp16"]
    cfg["bf16"] = {"enabled": "auto"}
    cfg["scheduler"] = _WARMUP_DECAY_AUTO
    return cfg


def zero2_decay(nvme: str) -> dict[str, Any]:
    cfg = zero2(nvme)
    cfg["scheduler"] = _WARMUP_DECAY_AUTO
    return cfg


def zero1(nvme: str) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 1}, "optimizer": _ADAMW_AUTO,
            "scheduler": _WARMUP_LR_AUTO, **_BATCH_AUTO}


def zero3_hf_optimizer(nvme: str) -> dict[str, Any]:
    """No optimizer/scheduler blocks: the Trainer's own (``optim``, ``lr_scheduler_type``)."""
    cfg = zero3(nvme)
    del cfg["optimizer"], cfg["scheduler"]
    cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


DOCS_CONFIGS = {f.__name__: f for f in (zero1, zero2, zero2_decay, zero3, zero3_nvme,
                                         zero3_decay_bf16, zero3_hf_optimizer)}
