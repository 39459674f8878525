"""initialize's host-memory preflight: a placement larger than the host's memory is a
CapacityError with the numbers and the keys, before anything is allocated; one that fits
trains. The machine is simulated with ZEROIO_HOST_MEMORY (and cgroup files in a folder)."""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

import zeroio
import zeroio.engine as engine_mod
from zeroio.config import load_config
from zeroio.errors import CapacityError, ConfigError
from zeroio.preflight import HostMemory, cgroup_free, host_items, shortfall_message
from zeroio.testing import run_ranks

CPU_OFFLOAD = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _need(cfg_dict: dict, model: nn.Module) -> int:
    """What the preflight counts for one rank on this CPU machine."""
    spec = types.SimpleNamespace(param_groups=[list(model.parameters())])
    items = host_items(load_config(cfg_dict), model, spec, torch.device("cpu"), world_size=1,
                       local_ranks=1)
    return sum(i.bytes_per_gpu for i in items)


def test_need_is_the_offloaded_state_counted_by_hand():
    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    # stage 2, fp32, optimizer on the CPU, one rank: fp32 master + 2 moments (12 bytes), the
    # fp32 gradient shard the CPU optimizer reads (4); on a CPU device also one reduce bucket
    # and the all-gather bucket, min(5e8, psi) fp32 elements each; the parameters exist already
    assert _need(CPU_OFFLOAD, model) == 12 * psi + 4 * psi + 4 * psi + 4 * psi


def test_small_machine_raises_with_the_numbers_before_any_allocation(monkeypatch):
    model = _model()
    need = _need(CPU_OFFLOAD, model)
    monkeypatch.setenv("ZEROIO_HOST_MEMORY", str(need - 1))
    built = []
    monkeypatch.setattr(engine_mod, "build_partitioner", lambda *a, **k: built.append(a))
    with pytest.raises(CapacityError) as e:
        zeroio.initialize(model=model, config=CPU_OFFLOAD)
    text = str(e.value)
    assert f"needs {need} bytes" in text and f"has {need - 1} bytes" in text, text
    assert "ZEROIO_HOST_MEMORY" in text and "offload_optimizer.device nvme" in text
    assert built == []  # nothing was partitioned, pinned or allocated


def test_fitting_machine_trains(monkeypatch):
    model = _model()
    monkeypatch.setenv("ZEROIO_HOST_MEMORY", str(_need(CPU_OFFLOAD, model)))
    engine, *_ = zeroio.initialize(model=model, config=CPU_OFFLOAD)
    x = torch.randn(2, 64)
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
    engine.close()


def test_off_skips_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("ZEROIO_HOST_MEMORY", "off")
    engine, *_ = zeroio.initialize(model=_model(), config=CPU_OFFLOAD)
    engine.close()
    monkeypatch.setenv("ZEROIO_HOST_MEMORY", "lots")
    with pytest.raises(ConfigError, match="ZEROIO_HOST_MEMORY='lots'"):
        zeroio.initialize(model=_model(), config=CPU_OFFLOAD)


def test_8b_llama_stage3_cpu_offload_with_accumulation_names_the_keys():
    """The field case: stage 3 + CPU offload, 8B Llama on 8 GPUs of one host: accumulation
    makes the host gradient fp32 (+2 bytes per parameter beyond the 16-bit one, and the
    staging slots); a host that holds the run at gas 1 is short at gas 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # shapes only: nothing allocated
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8))
    psi = sum(p.numel() for p in model.parameters())
    spec = types.SimpleNamespace(param_groups=[list(model.parameters())])
    need = {}
    for gas in (1, 8):
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                           "bf16": {"enabled": True},
                           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                 "offload_param": {"device": "cpu"}}}, world_size=8)
        items = host_items(cfg, model, spec, torch.device("cuda"), world_size=8, local_ranks=8)
        need[gas] = (sum(i.bytes_per_gpu for i in items) * 8, items, cfg)
    # by hand, per host: 12 (master + moments) + 2 (16-bit parameters) + 2 (16-bit gradient)
    assert need[1][0] == pytest.approx(16 * psi, rel=1e-3)
    assert need[8][0] - need[1][0] >= 2 * psi  # the fp32 host gradient beyond the 16-bit one
    host = HostMemory(available=(need[1][0] + need[8][0]) // 2, source="a simulated host")
    assert shortfall_message(need[1][1], 8, host, need[1][2]) is None
    text = shortfall_message(need[8][1], 8, host, need[8][2])
    assert f"needs {need[8][0]} bytes" in text and f"has {host.available} bytes" in text
    assert "gradient_accumulation_steps 1" in text and "offload_optimizer.device nvme" in text


def test_cgroup_limits_by_hand(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("3000000000\n")
    (v2 / "memory.stat").write_text("anon 2000000000\nfile 1000000000\ninactive_file 600000000\n")
    free, what = cgroup_free(v2)
    assert free == 8589934592 - (3000000000 - 600000000) and "cgroup v2" in what
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_free(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000000000\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 100000000\n")
    free, what = cgroup_free(v1)
    assert free == 4294967296 - 900000000 and "cgroup v1" in what
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "unlimited"
    assert cgroup_free(v1) is None


def _two_ranks_one_short():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.environ["ZEROIO_HOST_MEMORY"] = "1000"
    try:
        zeroio.initialize(model=_model(), config=CPU_OFFLOAD)
    except CapacityError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_one_short_rank_stops_every_rank():
    got = run_ranks(_two_ranks_one_short, 2)
    assert "has 1000 bytes" in got[1]
    assert got[0] is not None and "another rank" in got[0]


def test_memory_that_grows_on_use_warns_instead(tmp_path, monkeypatch):
    import zeroio.preflight as preflight
    from zeroio.errors import CapacityWarning

    sysfs = tmp_path / "sys"
    assert preflight.memory_may_grow(sysfs) is None
    for i, dev in enumerate(("0x0002", "0x0001")):  # block, net: memory stays as it is
        (sysfs / "bus/virtio/devices" / f"virtio{i}").mkdir(parents=True)
        (sysfs / "bus/virtio/devices" / f"virtio{i}" / "device").write_text(dev + "\n")
    assert preflight.memory_may_grow(sysfs) is None
    (sysfs / "bus/virtio/devices/virtio5").mkdir()
    (sysfs / "bus/virtio/devices/virtio5/device").write_text("0x0018\n")
    assert "virtio-mem" in preflight.memory_may_grow(sysfs)
    acpi = tmp_path / "acpi"
    (acpi / "bus/acpi/devices/PNP0C80:00").mkdir(parents=True)
    assert "ACPI" in preflight.memory_may_grow(acpi)
    # such a host shows only what is plugged in so far: a shortfall warns and the run goes on
    monkeypatch.delenv("ZEROIO_HOST_MEMORY", raising=False)
    monkeypatch.setattr(preflight, "memory_may_grow", lambda: "virtio-mem device virtio5")
    monkeypatch.setattr("psutil.virtual_memory", lambda: types.SimpleNamespace(available=1000))
    monkeypatch.setattr(preflight, "cgroup_free", lambda: None)
    with pytest.warns(CapacityWarning, match="has 1000 bytes .* may grow"):
        engine, *_ = zeroio.initialize(model=_model(), config=CPU_OFFLOAD)
    engine.close()


def test_a_host_budget_larger_than_the_host_is_refused(monkeypatch, tmp_path):
    """With NVMe offload, tiering.cpu_budget_bytes is what the stores fill with resident state:
    the preflight counts it (up to the NVMe-homed bytes), so a budget above the host fails."""
    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    cfg = {**CPU_OFFLOAD, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "tiering": {"cpu_budget_bytes": 10**12}}}
    spec = types.SimpleNamespace(param_groups=[list(model.parameters())])
    items = host_items(load_config(cfg), model, spec, torch.device("cpu"), world_size=1, local_ranks=1)
    resident = [i for i in items if "kept resident" in i.name]
    assert resident and resident[0].bytes_per_gpu == 8 * psi  # at most every fp32 moment
    without = sum(i.bytes_per_gpu for i in items) - 8 * psi
    monkeypatch.setenv("ZEROIO_HOST_MEMORY", str(without + 4 * psi))  # the rest fits, not the cache
    with pytest.raises(CapacityError, match="lower zero_optimization.tiering.cpu_budget_bytes"):
        zeroio.initialize(model=model, config=cfg)
