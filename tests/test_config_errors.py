"""Malformed configs: each is a ConfigError whose message and .key name the offending key."""

from __future__ import annotations

import pytest

from zeroio.config import load_config
from zeroio.errors import ConfigError

Z = "zero_optimization"

# (id, config, auto_values, key path expected on the error, text expected in the message)
MALFORMED = [
    ("unknown-top", {"train_batch_sise": 8}, {}, "train_batch_sise", 'did you mean "train_batch_size"'),
    ("unknown-zero", {Z: {"stage": 2, "overlap_com": True}}, {}, f"{Z}.overlap_com",
     'did you mean "overlap_comm"'),
    ("unknown-offload", {Z: {"stage": 3, "offload_param": {"device": "cpu", "pin_memori": True}}},
     {}, f"{Z}.offload_param.pin_memori", 'did you mean "pin_memory"'),
    ("unknown-aio", {"aio": {"queue_dept": 4}}, {}, "aio.queue_dept", 'did you mean "queue_depth"'),
    ("unknown-fp16", {"fp16": {"enabled": True, "initial_scale_pow": 8}}, {},
     "fp16.initial_scale_pow", 'did you mean "initial_scale_power"'),
    ("unknown-tiering", {Z: {"tiering": {"polcy": "lru"}}}, {}, f"{Z}.tiering.polcy",
     'did you mean "policy"'),
    ("unknown-optimizer-key", {"optimizer": {"type": "Adam", "parms": {}}}, {}, "optimizer.parms",
     'did you mean "params"'),
    ("unknown-adam-param", {"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, {},
     "optimizer.params.weight_decy", 'did you mean "weight_decay"'),
    ("unknown-sched-param", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 1}}}, {},
     "scheduler.params.warmup_max", "did you mean"),
    ("stage-too-big", {Z: {"stage": 4}}, {}, f"{Z}.stage", "0, 1, 2 or 3"),
    ("stage-string", {Z: {"stage": "3"}}, {}, f"{Z}.stage", "expected"),
    ("stage-bool", {Z: {"stage": True}}, {}, f"{Z}.stage", "expected"),
    ("stage-auto", {Z: {"stage": "auto"}}, {}, f"{Z}.stage", '"auto"'),
    ("bucket-fraction", {Z: {"reduce_bucket_size": 2.5}}, {}, f"{Z}.reduce_bucket_size", "integer"),
    ("bucket-negative", {Z: {"allgather_bucket_size": -1}}, {}, f"{Z}.allgather_bucket_size", ">= 1"),
    ("overlap-string", {Z: {"overlap_comm": "yes"}}, {}, f"{Z}.overlap_comm", "true or false"),
    ("offload-device", {Z: {"stage": 3, "offload_param": {"device": "gpu"}}}, {},
     f"{Z}.offload_param.device", '"none", "cpu", "nvme"'),
    ("offload-device-typo", {Z: {"offload_optimizer": {"device": "nvm", "nvme_path": "x"}}}, {},
     f"{Z}.offload_optimizer.device", 'did you mean "nvme"'),
    ("offload-not-object", {Z: {"offload_optimizer": "cpu"}}, {}, f"{Z}.offload_optimizer",
     "JSON object"),
    ("nvme-without-path", {Z: {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, {},
     f"{Z}.offload_optimizer.nvme_path", "nvme_path"),
    ("nvme-path-empty", {Z: {"offload_param": {"nvme_path": ""}}}, {},
     f"{Z}.offload_param.nvme_path", "non-empty string"),
    ("offload-param-stage2", {Z: {"stage": 2, "offload_param": {"device": "cpu"}}}, {},
     f"{Z}.offload_param.device", "stage 3"),
    ("buffer-count-negative", {Z: {"offload_optimizer": {"buffer_count": -2}}}, {},
     f"{Z}.offload_optimizer.buffer_count", ">= 0"),
    ("tiering-policy", {Z: {"tiering": {"policy": "random"}}}, {}, f"{Z}.tiering.policy",
     '"lru", "fifo", "trace"'),
    ("tiering-budget-string", {Z: {"tiering": {"gpu_budget_bytes": "8GB"}}}, {},
     f"{Z}.tiering.gpu_budget_bytes", "integer"),
    ("aio-block-zero", {"aio": {"block_size": 0}}, {}, "aio.block_size", "> 0"),
    ("aio-threads-bool", {"aio": {"thread_count": True}}, {}, "aio.thread_count", "integer"),
    ("fp16-enabled-int", {"fp16": {"enabled": 1}}, {}, "fp16.enabled", "true or false"),
    ("fp16-loss-scale-negative", {"fp16": {"loss_scale": -1}}, {}, "fp16.loss_scale", ">= 0"),
    ("fp16-window-zero", {"fp16": {"loss_scale_window": 0}}, {}, "fp16.loss_scale_window", "> 0"),
    ("fp16-and-bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, "bf16.enabled",
     "both"),
    ("bf16-not-object", {"bf16": True}, {}, "bf16", "JSON object"),
    ("batch-inconsistent", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                            "gradient_accumulation_steps": 1}, {"world_size": 2},
     "train_batch_size", "10 != 3 x 1 x 2"),
    ("batch-indivisible", {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}, {},
     "train_batch_size", "inconsistent"),
    ("batch-zero", {"train_micro_batch_size_per_gpu": 0}, {}, "train_micro_batch_size_per_gpu",
     "> 0"),
    ("batch-too-small-for-world", {"train_batch_size": 2}, {"world_size": 4}, "train_batch_size",
     "world_size"),
    ("clipping-negative", {"gradient_clipping": -1.0}, {}, "gradient_clipping", ">= 0"),
    ("clipping-nan", {"gradient_clipping": float("nan")}, {}, "gradient_clipping", "finite"),
    ("steps-per-print-string", {"steps_per_print": "10"}, {}, "steps_per_print", "integer"),
    ("optimizer-no-type", {"optimizer": {"params": {"lr": 1e-3}}}, {}, "optimizer.type", "required"),
    ("optimizer-unknown-type", {"optimizer": {"type": "AdamX"}}, {}, "optimizer.type",
     "did you mean"),
    ("optimizer-bad-betas", {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, {},
     "optimizer.params.betas", "two numbers"),
    ("optimizer-lr-string", {"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, {},
     "optimizer.params.lr", "number"),
    ("adamw-without-w-mode", {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, {},
     "optimizer.params.adam_w_mode", "contradicts"),
    ("scheduler-unknown", {"scheduler": {"type": "CosineLR"}}, {}, "scheduler.type", "WarmupLR"),
    ("scheduler-missing-required", {"scheduler": {"type": "WarmupDecayLR"}}, {},
     "scheduler.params.total_num_steps", "required"),
    ("scheduler-warmup-type", {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
     {}, "scheduler.params.warmup_type", '"log" or "linear"'),
    ("scheduler-params-list", {"scheduler": {"type": "WarmupLR", "params": [1]}}, {},
     "scheduler.params", "JSON object"),
    ("checkpoint-tag-validation", {"checkpoint": {"tag_validation": "Maybe"}}, {},
     "checkpoint.tag_validation", '"Ignore", "Warn" or "Fail"'),
    ("checkpoint-pipeline-stage", {"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, {},
     "checkpoint.parallel_write.pipeline_stage", "pipeline"),
    ("unimplemented-semantic", {Z: {"zero_quantized_gradients": True}}, {},
     f"{Z}.zero_quantized_gradients", "does not implement"),
    ("unimplemented-block-on", {"amp": {"enabled": True, "opt_level": "O1"}}, {}, "amp",
     "does not implement"),
    ("unimplemented-comm-dtype", {"communication_data_type": "fp16"}, {},
     "communication_data_type", "does not implement"),
    ("offload-ratio-needs-stage-1", {Z: {"stage": 0, "offload_optimizer": {"device": "cpu",
                                                                           "ratio": 0.5}}}, {},
     f"{Z}.offload_optimizer.ratio", "needs zero_optimization.stage 1, 2 or 3"),
    ("offload-ratio-out-of-range", {Z: {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                          "ratio": 0}}}, {},
     f"{Z}.offload_optimizer.ratio", "> 0.0 and <= 1.0"),
    ("legacy-cpu-offload-string", {Z: {"cpu_offload": "true"}}, {}, f"{Z}.cpu_offload",
     "true or false"),
    ("legacy-and-new-offload", {Z: {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     {}, f"{Z}.cpu_offload", "both set"),
    ("bf16-and-bfloat16", {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, {},
     "bfloat16", "legacy"),
    ("alias-conflict", {Z: {"stage3_prefetch_bucket_size": 10, "prefetch_bucket_size": 20}}, {},
     f"{Z}.prefetch_bucket_size", "different values"),
    ("auto-needs-hidden", {Z: {"stage": 3, "stage3_param_persistence_threshold": "auto"}}, {},
     f"{Z}.stage3_param_persistence_threshold", "hidden_size"),
    ("auto-unsupported-key", {"aio": {"queue_depth": "auto"}}, {}, "aio.queue_depth", '"auto"'),
    ("auto-fp16-without-arg", {"fp16": {"enabled": "auto"}}, {}, "fp16.enabled", "fp16=..."),
    ("auto-batch-underivable", {"train_batch_size": "auto"}, {}, "train_batch_size",
     "per_device_train_batch_size"),
    ("kwarg-typo", {}, {"hiden_size": 8}, "hiden_size", 'did you mean "hidden_size"'),
    ("kwarg-bad-value", {}, {"world_size": 0}, "world_size", "positive integer"),
    ("non-string-key", {1: 2}, {}, "", "strings"),
]


@pytest.mark.parametrize("raw,auto,key,text", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_config_is_rejected_naming_the_key(raw, auto, key, text):
    with pytest.raises(ConfigError) as e:
        load_config(raw, **auto)
    message = str(e.value)
    assert text in message, message
    if key:
        assert e.value.key == key, (e.value.key, message)
        assert key in message, message


def test_at_least_thirty_malformed_cases():
    assert len(MALFORMED) >= 30
    assert len({m[0] for m in MALFORMED}) == len(MALFORMED)


def test_error_names_the_value_and_the_expectation():
    with pytest.raises(ConfigError) as e:
        load_config({Z: {"stage": 3, "offload_param": {"device": "disk"}}})
    msg = str(e.value)
    assert "zero_optimization.offload_param.device" in msg and '"disk"' in msg
    assert '"none", "cpu", "nvme"' in msg
    assert isinstance(e.value, ValueError)
