"""Every config of the DeepSpeed Hugging Face integration docs loads on zeroio with its
"auto" values filled by transformers' own DeepSpeed code from TrainingArguments.

Reference: the TrainingArguments themselves (the values the docs say "auto" takes);
the path is transformers' HfTrainerDeepSpeedConfig (trainer_config_process, then
trainer_config_finalize with the model and the step count), then accelerate's
``steps_per_print`` = inf, then the facade's hand-over to ``zeroio.load_config``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import zeroio.deepspeed  # noqa: E402,F401  (the facade: transformers' DeepSpeed code imports)
from zeroio.deepspeed.ds_config import for_zeroio  # noqa: E402
from zeroio.testing.hf_ds_configs import DOCS_CONFIGS  # noqa: E402


class _Model(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": hidden})()


def _filled(raw: dict, args, steps: int, hidden: int) -> dict:
    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    try:
        hf = HfTrainerDeepSpeedConfig(raw)
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, _Model(hidden), steps)
        config = dict(hf.config)
    finally:
        unset_hf_deepspeed_config()
    config["steps_per_print"] = float("inf")  # what accelerate's plugin sets
    return config


@pytest.mark.parametrize("name", sorted(DOCS_CONFIGS))
def test_docs_config_loads_with_auto_from_training_arguments(name, tmp_path):
    from transformers import TrainingArguments

    import zeroio

    bf16 = name.endswith("bf16")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=3,
        gradient_accumulation_steps=4, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95,
        adam_epsilon=1e-7, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=7,
        bf16=bf16, use_cpu=True, report_to="none")
    (tmp_path / "nvme").mkdir()
    raw = DOCS_CONFIGS[name](str(tmp_path / "nvme"))
    hidden, steps = 64, 50
    cfg = zeroio.load_config(for_zeroio(_filled(raw, args, steps, hidden)), world_size=1)

    assert cfg.train_micro_batch_size_per_gpu == 3
    assert cfg.gradient_accumulation_steps == 4
    assert cfg.train_batch_size == 12
    assert cfg.gradient_clipping == pytest.approx(0.5)
    assert cfg.zero_optimization.stage == raw["zero_optimization"]["stage"]
    assert cfg.steps_per_print is None  # inf: never print, as DeepSpeed
    assert cfg.bf16.enabled is bf16
    if "optimizer" in raw:
        p = cfg.optimizer.params
        assert p["lr"] == pytest.approx(2e-4)
        assert tuple(p["betas"]) == pytest.approx((0.8, 0.95))
        assert p["eps"] == pytest.approx(1e-7) and p["weight_decay"] == pytest.approx(0.01)
    if "scheduler" in raw:
        s = cfg.scheduler.params
        assert s["warmup_max_lr"] == pytest.approx(2e-4) and s["warmup_min_lr"] == 0
        assert s["warmup_num_steps"] == 7
        if raw["scheduler"]["type"] == "WarmupDecayLR":
            assert s["total_num_steps"] == steps
    if raw["zero_optimization"].get("reduce_bucket_size") == "auto":
        assert cfg.zero_optimization.reduce_bucket_size == hidden * hidden
        assert cfg.zero_optimization.stage3_param_persistence_threshold == 10 * hidden
