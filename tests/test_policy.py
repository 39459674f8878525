"""Offload and tiering resolved once (zeroio/config/policy.py): frozen policy objects carrying
what each consumer needs, and keys set in JSON reaching the consumer through them."""

from __future__ import annotations

import dataclasses

import pytest

from zeroio.config import load_config
from zeroio.config.policy import resolve_policies
from zeroio.partition.stage3.settings import Stage3Settings

CFG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 7,
        "offload_optimizer": {"device": "cpu", "ratio": 0.25, "pin_memory": False},
        "offload_param": {"device": "nvme", "nvme_path": "/tmp/zeroio-policy", "buffer_count": 3,
                          "buffer_size": 1000, "max_in_cpu": 11},
        "tiering": {"cpu_budget_bytes": 123456, "prefetch_depth": 5, "overlap_step": True,
                    "step_assist": False},
    },
}


def test_policies_are_frozen_and_carry_the_json_keys(monkeypatch):
    monkeypatch.delenv("ZEROIO_OVERLAP_STEP", raising=False)
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    cfg = load_config(CFG, world_size=1)
    pol = resolve_policies(cfg.zero_optimization, accumulation_steps=3, device="cpu")
    for obj in (pol, pol.optimizer, pol.param, pol.tiering):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.device = "gpu"
    assert (pol.optimizer.device, pol.optimizer.ratio, pol.optimizer.pin_memory) == ("cpu", 0.25,
                                                                                   False)
    assert pol.optimizer.cpu and pol.accumulation_steps == 3
    assert (pol.param.device, pol.param.nvme_path, pol.param.buffer_count, pol.param.buffer_size,
            pol.param.max_in_cpu) == ("nvme", "/tmp/zeroio-policy", 3, 1000, 11)
    assert (pol.tiering.cpu_budget_bytes, pol.tiering.prefetch_depth) == (123456, 5)
    assert pol.tiering.overlap_step and not pol.tiering.step_assist
    # the stage-3 partitioner's settings take them (its NVMe store reads settings.tiering)
    s = Stage3Settings.from_policies(pol, zero=cfg.zero_optimization, aio=cfg.aio)
    assert (s.optimizer_ratio, s.cpu_optimizer, s.accumulation_steps) == (0.25, True, 3)
    assert (s.offload_device, s.nvme_path, s.max_in_cpu) == ("nvme", "/tmp/zeroio-policy", 11)
    assert s.host_buffer_bytes == 3 * 1000 * 2 and s.persistence_threshold == 7
    assert s.overlap_step and s.tiering is pol.tiering and s.aio is cfg.aio
    assert s.tiering.cpu_budget_bytes == 123456


def test_ratio_is_one_without_optimizer_offload_and_env_overrides_apply(monkeypatch):
    raw = {**CFG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none",
                                                                          "ratio": 0.5}}}
    # the overrides apply where the config is loaded (config/overrides.py)
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "1")
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", "1")  # on, but no CPU optimizer: not asked
    cfg = load_config(raw, world_size=1)
    pol = resolve_policies(cfg.zero_optimization, device="cpu")
    assert pol.optimizer.ratio == 1.0 and not pol.optimizer.cpu
    assert pol.tiering.overlap_step and not pol.tiering.step_assist
