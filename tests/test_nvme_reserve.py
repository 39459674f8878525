"""The NVMe reserve: a file system with less free space than ``nvme_reserve_bytes``.

The derived NVMe budget is free space minus the reserve, so such a file system
has an NVMe tier of 0 bytes. The failure must say so (path, free bytes, reserve,
config key), not "set an nvme_path" when one is set; the key is a documented
config key; `zeroio train`'s pre-flight catches it before the model is built.
"""

from __future__ import annotations

import collections
import shutil

import pytest
import torch

from zeroio.config import load_config
from zeroio.config.policy import resolve_policies
from zeroio.errors import CapacityError
from zeroio.tiering import Tier, TieredStore

GiB = 1 << 30
FREE = 300 << 20  # 300 MiB free: plenty for the tensors here, below the default 1 GiB reserve


@pytest.fixture
def low_disk(monkeypatch):
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(real(p).total, real(p).used, FREE))


def _nvme_config(path, **tiering):
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)},
        "tiering": tiering}})


def _policy(path, **tiering):
    return resolve_policies(_nvme_config(path, **tiering).zero_optimization).tiering


def test_reserve_is_a_config_key_read_by_the_store():
    assert load_config({}).zero_optimization.tiering.nvme_reserve_bytes == GiB
    cfg = _nvme_config("/x", nvme_reserve_bytes=4096)
    assert cfg.zero_optimization.tiering.nvme_reserve_bytes == 4096
    assert resolve_policies(cfg.zero_optimization).tiering.nvme_reserve_bytes == 4096


def test_register_below_the_reserve_names_path_free_reserve_and_key(tmp_path, low_disk):
    store = TieredStore(_policy(tmp_path), nvme_path=tmp_path, cpu_budget_bytes=1 << 20,
                        gpu_budget_bytes=0)
    try:
        with pytest.raises(CapacityError) as e:
            store.register("w", (1024,), torch.float32, home=Tier.NVME)
    finally:
        store.close()
    msg = str(e.value)
    assert str(tmp_path) in msg and f"{FREE:,}" in msg and f"{GiB:,}" in msg, msg
    assert "zero_optimization.tiering.nvme_reserve_bytes" in msg, msg
    assert "set an nvme_path" not in msg, msg


def test_a_lower_reserve_from_the_config_lets_the_same_disk_hold_the_tensor(tmp_path, low_disk):
    store = TieredStore(_policy(tmp_path, nvme_reserve_bytes=0), nvme_path=tmp_path,
                        cpu_budget_bytes=1 << 20, gpu_budget_bytes=0)
    try:
        assert store.register("w", (1024,), torch.float32, home=Tier.NVME,
                              init=torch.arange(1024.0)) is Tier.NVME
        assert store.budgets.nvme == FREE
    finally:
        store.close()


@pytest.mark.slow
def test_train_preflight_catches_it_before_the_model_is_built(tmp_path, low_disk, monkeypatch,
                                                              capsys):
    from zeroio.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    # the tiny run's checkpoint + model + swap fit in 300 MiB: only the reserve is in the way
    rc = main(["train", "--steps", "1", "--seq-len", "64", "--micro-batch", "2", "--nproc", "1",
               "--json", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert str(out / "nvme") in err and f"{FREE:,}" in err and f"{GiB:,}" in err, err
    assert "zero_optimization.tiering.nvme_reserve_bytes" in err and "set an nvme_path" not in err
    assert not (out / "checkpoints").exists()  # failed before anything was prepared or built
