"""load_config: shipped configs, realistic DeepSpeed/HF configs, defaults, aliases, auto, batch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import zeroio
from zeroio.config import ConfigWarning, OffloadDevice, load_config
from zeroio.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.json"))


# ---------------------------------------------------------------- shipped files

def test_configs_folder_has_every_preset():
    names = {p.stem for p in CONFIG_FILES}
    for stem in ("zero1", "zero2", "zero2-cpu", "zero3", "zero3-cpu", "zero3-nvme"):
        assert stem in names and f"{stem}-fp16" in names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    raw = json.loads(path.read_text())
    cfg = zeroio.load_config(path, world_size=2)
    zero = raw["zero_optimization"]
    assert cfg.zero_optimization.stage == zero["stage"]
    assert cfg.compute_dtype == ("fp16" if path.stem.endswith("-fp16") else "bf16")
    expect_opt = zero.get("offload_optimizer", {}).get("device", "none")
    assert cfg.zero_optimization.offload_optimizer.device.value == expect_opt
    assert ("cpu" in path.stem) == (expect_opt == "cpu")
    assert ("nvme" in path.stem) == (expect_opt == "nvme")
    if expect_opt == "nvme":
        assert not Path(cfg.zero_optimization.offload_optimizer.nvme_path).is_absolute()
    assert cfg.train_batch_size == raw["train_micro_batch_size_per_gpu"] * 2
    assert cfg.unimplemented == {}


# -------------------------------------------------------------------- defaults

def test_defaults_are_deepspeed_019_source_defaults():
    cfg = load_config({})
    z = cfg.zero_optimization
    assert (z.stage, z.overlap_comm, z.contiguous_gradients) == (0, False, True)
    assert z.reduce_bucket_size == 500_000_000 and z.allgather_bucket_size == 500_000_000
    assert z.sub_group_size == 1_000_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False
    oo, op = z.offload_optimizer, z.offload_param
    assert (oo.device, oo.nvme_path, oo.buffer_count, oo.pin_memory) == ("none", None, 4, True)
    assert (oo.pipeline_read, oo.pipeline_write, oo.pipeline) == (False, False, False)
    assert (op.device, op.buffer_count, op.buffer_size, op.max_in_cpu, op.pin_memory) == (
        "none", 5, 100_000_000, 1_000_000_000, True)
    t = z.tiering
    assert (t.policy, t.prefetch_depth) == ("trace", None)  # docs/tiering.md: the default
    assert t.gpu_budget_bytes is t.cpu_budget_bytes is t.nvme_budget_bytes is None
    a = cfg.aio
    assert (a.block_size, a.queue_depth, a.intra_op_parallelism) == (1_048_576, 8, 1)
    assert (a.single_submit, a.overlap_events, a.use_gds) == (False, True, False)
    f = cfg.fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window) == (
        False, 0.0, 16, 1000)
    assert (f.hysteresis, f.consecutive_hysteresis, f.min_loss_scale) == (2, False, 1)
    assert cfg.bf16.enabled is False and cfg.compute_dtype == "fp32"
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print is None
    assert cfg.wall_clock_breakdown is False and cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.checkpoint.tag_validation.value == "Warn"
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (1, 1, 1)


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_defaults_on_for_stage3_only(stage, expected):
    assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm is expected
    cfg = load_config({"zero_optimization": {"stage": stage, "overlap_comm": not expected}})
    assert cfg.zero_optimization.overlap_comm is (not expected)


def test_config_is_frozen():
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.train_batch_size = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.zero_optimization.stage = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        load_config({"optimizer": {"type": "Adam"}}).optimizer.params["lr"] = 1.0


# -------------------------------------------------------------- realistic files

HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

TRAINER_ARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=8,
                    learning_rate=2e-5, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
                    weight_decay=0.01, max_grad_norm=0.5, num_training_steps=1000,
                    warmup_steps=30)


def test_hf_zero2_example_with_auto():
    cfg = load_config(HF_ZERO2, world_size=4, fp16=True, bf16=False, **TRAINER_ARGS)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
            cfg.train_batch_size) == (4, 8, 4 * 8 * 4)
    assert cfg.gradient_clipping == 0.5 and cfg.fp16.enabled and not cfg.bf16.enabled
    p = cfg.optimizer.params
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.name == "adamw"
    assert (p["lr"], p["betas"], p["eps"], p["weight_decay"]) == (2e-5, [0.9, 0.98], 1e-6, 0.01)
    s = cfg.scheduler.params
    assert (s["warmup_min_lr"], s["warmup_max_lr"], s["warmup_num_steps"]) == (0.0, 2e-5, 30)
    z = cfg.zero_optimization
    assert z.stage == 2 and z.offload_optimizer.device is OffloadDevice.CPU
    assert z.offload_optimizer.pin_memory is True
    assert z.allgather_bucket_size == z.reduce_bucket_size == 200_000_000
    assert isinstance(z.reduce_bucket_size, int)
    assert cfg.steps_per_print == 2000
    # DeepSpeed keys zeroio does not implement, given at their default: accepted, recorded.
    assert dict(cfg.unimplemented) == {"zero_optimization.allgather_partitions": True,
                                       "zero_optimization.reduce_scatter": True}


def test_hf_zero3_example_with_auto_and_hidden_size():
    cfg = load_config(HF_ZERO3, world_size=2, hidden_size=1024, fp16=False, bf16=True,
                      **TRAINER_ARGS)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 1024 * 1024
    assert z.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert z.stage3_param_persistence_threshold == 10 * 1024
    assert z.offload_param.device == "cpu" and z.stage3_gather_16bit_weights_on_model_save
    assert cfg.bf16.enabled and cfg.compute_dtype == "bf16"
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params["total_num_steps"] == 1000
    assert cfg.train_batch_size == 2 * 4 * 8


def test_auto_left_unfilled_is_an_error_naming_the_argument():
    with pytest.raises(ConfigError, match="hidden_size") as e:
        load_config(HF_ZERO3, world_size=2, fp16=False, bf16=True, **TRAINER_ARGS)
    assert e.value.key == "zero_optimization.reduce_bucket_size"
    with pytest.raises(ConfigError, match="learning_rate") as e:
        load_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert e.value.key == "optimizer.params.lr"
    with pytest.raises(ConfigError, match="per_device_train_batch_size") as e:
        load_config({"train_micro_batch_size_per_gpu": "auto"})
    assert e.value.key == "train_micro_batch_size_per_gpu"


def test_auto_batch_key_derived_from_the_other_two():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": 2}, world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 4


ZERO_INFINITY = {
    "train_micro_batch_size_per_gpu": 1,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 500, "hysteresis": 4, "consecutive_hysteresis": True,
             "min_loss_scale": 8},
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
        "sub_group_size": 1e8,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False,
                              "pipeline_read": True, "pipeline_write": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
            "single_submit": False, "overlap_events": True},
}


def test_zero_infinity_nvme_config_with_aio_and_fp16_loss_scale():
    cfg = load_config(ZERO_INFINITY, world_size=8)
    z = cfg.zero_optimization
    assert z.offload_optimizer.device is OffloadDevice.NVME and z.offload_param.device == "nvme"
    assert z.offload_optimizer.nvme_path == "/local_nvme" and z.offload_optimizer.pipeline
    assert z.offload_param.buffer_size == 100_000_000 and z.sub_group_size == 100_000_000
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism) == (
        262144, 32, 1)
    f = cfg.fp16
    assert (f.enabled, f.dynamic, f.initial_scale_power, f.loss_scale_window) == (
        True, True, 12, 500)
    assert (f.hysteresis, f.consecutive_hysteresis, f.min_loss_scale) == (4, True, 8)
    assert cfg.train_batch_size == 8
    static = load_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.fp16.loss_scale == 128.0 and not static.fp16.dynamic


SCHEDULERS = [
    ("WarmupLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 10},
     {"warmup_min_lr": 0.0, "warmup_type": "log", "last_batch_iteration": -1}),
    ("WarmupDecayLR", {"total_num_steps": 100, "warmup_type": "linear"},
     {"warmup_max_lr": 0.001, "warmup_num_steps": 1000}),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_min_ratio": 0.1},
     {"cos_min_ratio": 0.0001, "warmup_num_steps": 1000}),
    ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 500},
     {"cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
      "cycle_second_step_size": None}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_staircase": True},
     {"lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0}),
]


@pytest.mark.parametrize("type_,given,defaults", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_each_scheduler_type_loads_with_given_and_default_params(type_, given, defaults):
    cfg = load_config({"scheduler": {"type": type_, "params": given}})
    assert cfg.scheduler.type == type_
    for key, value in {**given, **defaults}.items():
        assert cfg.scheduler.params[key] == value, key


def test_adam_params_filled_with_deepspeed_defaults():
    adam = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}).optimizer
    assert adam.params["adam_w_mode"] is True  # DeepSpeed's Adam decouples weight decay
    assert adam.params["weight_decay"] == 0.0 and adam.params["betas"] == [0.9, 0.999]
    l2 = load_config({"optimizer": {"type": "adam", "params": {"adam_w_mode": False}}}).optimizer
    assert l2.params["adam_w_mode"] is False and l2.type == "adam" and l2.name == "adam"
    other = load_config({"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9}}})
    assert dict(other.optimizer.params) == {"lr": 1e-3, "alpha": 0.9}  # not stepped: as written
    lamb = load_config({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}}})
    assert dict(lamb.optimizer.params) == {  # DeepSpeed FusedLamb's defaults
        "lr": 1e-3, "max_coeff": 0.3, "betas": [0.9, 0.999], "eps": 1e-8,
        "eps_inside_sqrt": False, "weight_decay": 0.0, "bias_correction": True,
        "max_grad_norm": 0.0, "min_coeff": 0.01, "amsgrad": False}


# ---------------------------------------------------------------------- aliases

def test_legacy_aliases_map_to_current_names():
    cfg = load_config({
        "bfloat16": {"enabled": True},
        "aio": {"thread_count": 3},
        "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                              "cpu_offload_use_pin_memory": True,
                              "stage3_gather_fp16_weights_on_model_save": True,
                              "prefetch_bucket_size": 123, "max_live_parameters": 7}})
    z = cfg.zero_optimization
    assert cfg.bf16.enabled and cfg.aio.intra_op_parallelism == 3
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert z.stage3_prefetch_bucket_size == 123 and z.stage3_max_live_parameters == 7
    old = load_config({"zero_optimization": True, "allgather_size": 1000})
    assert old.zero_optimization.stage == 1 and old.zero_optimization.allgather_bucket_size == 1000
    off = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert off.zero_optimization.offload_optimizer.device == "none"


def test_alias_and_current_name_agreeing_is_fine_disagreeing_is_an_error():
    same = load_config({"aio": {"thread_count": 2, "intra_op_parallelism": 2}})
    assert same.aio.intra_op_parallelism == 2
    with pytest.raises(ConfigError, match="thread_count") as e:
        load_config({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})
    assert e.value.key.startswith("aio.")


# -------------------------------------------------------------- batch triple

@pytest.mark.parametrize("given,ws,expected", [
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ({"gradient_accumulation_steps": 4}, 2, (8, 1, 4)),  # not read as 1
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 4, (64, 4, 4)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, (64, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}, 3, (30, 2, 5)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3}, 4, (24, 2, 3)),
])
def test_batch_triple_completion(given, ws, expected):
    cfg = load_config(given, world_size=ws)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected and got[0] == got[1] * got[2] * ws


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert load_config({"train_micro_batch_size_per_gpu": 2}).train_batch_size == 6
    assert load_config({"train_micro_batch_size_per_gpu": 2}, world_size=1).train_batch_size == 2
    monkeypatch.setenv("WORLD_SIZE", "zero")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        load_config({})


# ------------------------------------------------------- unimplemented DeepSpeed keys

def test_tolerated_key_warns_when_not_default_and_is_recorded():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"tensorboard": {"enabled": False, "output_path": "x"}})
    assert "tensorboard" in cfg.unimplemented
    with pytest.warns(ConfigWarning, match="zero_optimization.round_robin_gradients"):
        cfg = load_config({"zero_optimization": {"stage": 2, "round_robin_gradients": True}})
    assert cfg.unimplemented["zero_optimization.round_robin_gradients"] is True


def test_semantic_unimplemented_key_at_non_default_is_an_error():
    with pytest.raises(ConfigError, match="does not implement") as e:
        load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert e.value.key == "zero_optimization.zero_quantized_weights"


# -------------------------------------------------------------------- to_dict

@pytest.mark.parametrize("source", ["zero3-nvme.json", "zero2-cpu-fp16.json", "hf_zero3"])
def test_to_dict_is_json_and_round_trips(source):
    if source == "hf_zero3":
        cfg = load_config(HF_ZERO3, world_size=2, hidden_size=64, fp16=False, bf16=True,
                          **TRAINER_ARGS)
    else:
        cfg = load_config(ROOT / "configs" / source, world_size=4)
    d = cfg.to_dict()
    text = json.dumps(d)
    again = load_config(json.loads(text), world_size=cfg.world_size)
    assert again.to_dict() == d
    assert dataclasses.replace(again, unimplemented=cfg.unimplemented) == cfg


def test_loading_from_path_and_errors_for_bad_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_batch_size": 4}))
    assert load_config(str(p)).train_batch_size == 4
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(p)
    with pytest.raises(ConfigError):
        load_config(42)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("bad\x00path.json")  # found by the hypothesis test
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


def test_load_config_does_not_import_torch():
    code = ("import sys, zeroio; zeroio.load_config('configs/zero3-nvme.json'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_docs_mention_every_key_and_unimplemented_key():
    from tests.test_config_fuzz import KNOWN_PATHS

    text = (ROOT / "docs" / "config.md").read_text()
    missing = [p for p in KNOWN_PATHS if f"`{p.rsplit('.', 1)[-1]}" not in text
               and p.rsplit(".", 1)[-1] not in text]
    assert not missing, missing


def test_config_instance_passes_through():
    cfg = load_config(ROOT / "configs" / "zero2.json", world_size=2)
    assert load_config(cfg) is cfg
    with pytest.raises(ConfigError, match="8 != 4 x 1 x 3"):
        load_config(cfg, world_size=3)  # resolved batch sizes no longer multiply out
