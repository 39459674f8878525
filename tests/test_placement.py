"""The one placement (zeroio/placement.py) on made-up machines, against hand counts of the bytes
each buffer puts on each tier of one rank; the running engine's ``stats()["placement"]`` is
what ``decide_placement`` returns for the same inputs; ``zeroio train --plan --json`` shows the
placement the engine then trains with.

Hand counts use DeepSpeed's default sizes (reduce / all-gather buckets 5e8 elements,
stage3_max_live_parameters 1e9, offload_param buffer_count 5 x buffer_size 1e8, offload_optimizer
buffer_count 4, sub_group_size 1e9), bf16 (b = 2 bytes), a stage-3 group G = 2e8 elements and
the pinned staging of an accumulated host gradient: STAGING_SLOTS (3) fp32 slots of one
group's slice per rank (stage 3) or of one 2^25-element gradient piece (stage 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zeroio
from zeroio.cli.main import main
from zeroio.config import load_config
from zeroio.errors import ConfigError
from zeroio.placement import BUFFERS, MachineMemory, buffer_of, decide_placement, render_table

GB = 10**9
G = 200_000_000  # stage 3's largest flat group
SLOTS, PIECE = 3, 1 << 25
PUBLISH = 2 * 2 * (1 << 26)  # stage 1/2's pinned 16-bit publish staging: 2 chunks of 64M
# made-up machines (per node)
SMALL = dict(gpu_bytes=24 * GB, host_bytes=64 * GB, nvme_free_bytes=2000 * GB)
LARGE = dict(gpu_bytes=80 * GB, host_bytes=1000 * GB, nvme_free_bytes=0)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)  # host gradients: the auto rule
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def _cfg(zero: dict, gas: int = 1, world: int = 1, bf16: bool = True):
    raw = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "zero_optimization": zero}
    if bf16:
        raw["bf16"] = {"enabled": True}
    return load_config(raw, world_size=world)


def _tiers(gpu=0, cpu=0, nvme=0) -> dict:
    return {"gpu": gpu, "cpu": cpu, "nvme": nvme}


def _check(p, expected: dict, windows: dict | None = None) -> None:
    got = {b.kind: b.tiers for b in p.buffers}
    assert got == {k: expected.get(k, _tiers()) for k in BUFFERS}
    assert {b.kind: b.window_bytes for b in p.buffers} == {k: (windows or {}).get(k, 0)
                                                           for k in BUFFERS}
    for t in ("gpu", "cpu", "nvme"):  # nothing counted twice or dropped: the estimate's sums
        assert p.tier_bytes(t) == p.estimate.per_gpu(t)


def test_stage2_all_on_the_large_gpu():
    psi = 10**9
    p = decide_placement(num_params=psi, config=_cfg({"stage": 2}), world_size=1,
                         machine=MachineMemory(**LARGE))
    # gradients: the 16-bit partition 2 Psi + the fp32 shard the optimizer reads 4 Psi;
    # one 16-bit reduce bucket (overlap_comm off at stage 2) and the all-gather bucket
    _check(p, {"param16": _tiers(gpu=2 * psi), "master": _tiers(gpu=4 * psi),
               "moments": _tiers(gpu=8 * psi), "grad": _tiers(gpu=6 * psi),
               "comm": _tiers(gpu=2 * 5 * 10**8 + 2 * 5 * 10**8)})
    assert p.resident_chunks == {"enabled": False, "cap_bytes": 0}
    assert p.to_dict()["totals"] == {"gpu": 22 * psi, "cpu": 0, "nvme": 0}


@pytest.mark.parametrize("gas", [1, 8])
def test_stage2_cpu_offload_accumulation_on_the_small_machine(gas):
    psi = 3 * 10**9
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"},
            "tiering": {"step_assist": False}}
    p = decide_placement(num_params=psi, config=_cfg(zero, gas), world_size=1,
                         machine=MachineMemory(**SMALL))
    # stage 2's host gradient shard (one, the 2-byte partition and what it holds beyond):
    # 16-bit with one micro step (the one-pass CPU Adam), fp32 summed over several; the plan
    # knows no device room, so the gradient is in host memory ([Note: the gradient's home])
    grad_host = (2 if gas == 1 else 4) * psi
    want = {"param16": _tiers(gpu=2 * psi), "master": _tiers(cpu=4 * psi),
            "moments": _tiers(cpu=8 * psi), "grad": _tiers(cpu=grad_host),
            "comm": _tiers(gpu=2 * 10**9)}
    want["staging"] = _tiers(cpu=PUBLISH)  # [Note: publishing] in partition/stage12.py
    if gas > 1:  # the plan does not know the room: the host path's pinned staging
        want["staging"] = _tiers(cpu=4 * SLOTS * PIECE + PUBLISH)
    _check(p, want)
    assert p.accumulation_steps == gas and p.resident_chunks["enabled"] is False


@pytest.mark.parametrize("machine,on_gpu", [(SMALL, False), (LARGE, True)])
def test_measured_room_decides_the_accumulation_buffer(machine, on_gpu):
    # the fp32 sum of 3e9 host elements is 12 GB: "auto" places it on the device when it fits
    # half the free memory less 2 GiB: 12 GB > 22/2 - 2.1 on the 24 GB GPU, < 78/2 - 2.1 on 80
    psi = 3 * 10**9
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"},
            "tiering": {"step_assist": False}}
    free = machine["gpu_bytes"] - 2 * GB
    p = decide_placement(num_params=psi, config=_cfg(zero, 8), world_size=1,
                         machine=MachineMemory(**machine, gpu_free_bytes=free))
    acc, staging = p.buffer("accumulation"), p.buffer("staging")
    if on_gpu:  # the gradient's home: the host reads it through the window
        assert acc.tiers == _tiers(gpu=4 * psi) and staging.tiers == _tiers(cpu=PUBLISH)
        assert p.gradient_on_device and p.buffer("grad").tiers == _tiers()
    else:
        assert acc.tiers == _tiers() and staging.tiers == _tiers(cpu=4 * SLOTS * PIECE + PUBLISH)
        assert not p.gradient_on_device and p.buffer("grad").tiers == _tiers(cpu=4 * psi)
    # a CPU device (room 0) never takes it; an explicit budget that covers it does in a plan
    cpu = decide_placement(num_params=psi, config=_cfg(zero, 8), world_size=1,
                           machine=MachineMemory(**machine, gpu_free_bytes=0))
    assert cpu.buffer("accumulation").tiers == _tiers()
    budget = _cfg({**zero, "tiering": {"step_assist": False, "gpu_budget_bytes": 13 * GB}}, 8)
    planned = decide_placement(num_params=psi, config=budget, world_size=1,
                               machine=MachineMemory(**machine))
    assert planned.buffer("accumulation").tiers == _tiers(gpu=4 * psi)
    assert planned.budgets == {"gpu": 13 * GB, "cpu": None, "nvme": None}


@pytest.mark.parametrize("gas", [1, 8])
def test_stage3_cpu_offload_on_eight_large_gpus(gas):
    psi, n = 7 * 10**9, 8
    shard = psi // n
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    p = decide_placement(num_params=psi, config=_cfg(zero, gas, world=n), world_size=n,
                         machine=MachineMemory(**LARGE, gpus_per_node=n), largest_group=G)
    # stage 3 host gradient: 16-bit with one micro-step (the one-pass CPU Adam), fp32 summed
    want = {"param16": _tiers(gpu=2 * shard), "master": _tiers(cpu=4 * shard),
            "moments": _tiers(cpu=8 * shard), "grad": _tiers(cpu=(2 if gas == 1 else 4) * shard),
            "grad16": _tiers(gpu=2 * G),
            # fp32 buckets of one group, two; live gathered parameters (1e9 + G) x 2
            "comm": _tiers(gpu=2 * 4 * G + 2 * (10**9 + G))}
    if gas > 1:  # one group's slice per rank, three pinned fp32 slots
        want["staging"] = _tiers(cpu=4 * SLOTS * (G // n))
    _check(p, want)
    # the step assist (auto on CUDA) keeps host chunks on the GPU between steps: a cache, no home
    assert p.resident_chunks == {"enabled": True, "cap_bytes": None}
    assert "GPU-resident optimizer chunks: cap auto" in "\n".join(render_table(p))


def test_stage3_nvme_offload_on_the_small_machine():
    psi, n = 4 * 10**9, 2
    shard = psi // n
    nvme = {"device": "nvme", "nvme_path": "/tmp/zeroio-placement-test"}
    zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme,
            "tiering": {"params_from_master": False}}
    p = decide_placement(num_params=psi, config=_cfg(zero, world=n), world_size=n,
                         machine=MachineMemory(**SMALL, gpus_per_node=n), largest_group=G)
    live = 10**9 + G
    # offload_param.max_in_cpu (1e9 elements, DeepSpeed's default) keeps whole group shards
    # (G / n = 1e8 elements each) in host memory: 10 of them, 2 GB; the rest is on the disk
    resident = 10 * (G // n) * 2
    _check(p, {"param16": _tiers(cpu=resident, nvme=2 * shard - resident),
               "master": _tiers(cpu=4 * shard),
               "moments": _tiers(nvme=8 * shard), "grad": _tiers(cpu=2 * shard),
               "grad16": _tiers(gpu=2 * G), "comm": _tiers(gpu=2 * 4 * G + 2 * live),
               # each live group's shard is copied in before its all-gather
               "staging": _tiers(gpu=2 * live // n)},
           # host windows: parameter swap buffers 5 x 1e8 x 2; the moments' swap buffers
           # 4 x min(sub_group_size, shard) x 4 bytes
           windows={"param16": 5 * 10**8 * 2, "moments": 4 * 10**9 * 4})
    assert p.tier_bytes("cpu") == resident + 4 * shard + 2 * shard + 10**9 + 16 * 10**9


def test_params_from_master_holds_no_16bit_shard():
    psi, n = 4 * 10**9, 2
    nvme = {"device": "nvme", "nvme_path": "/tmp/zeroio-placement-test"}
    p = decide_placement(num_params=psi, config=_cfg({"stage": 3, "offload_optimizer": nvme},
                                                      world=n),
                         world_size=n, machine=MachineMemory(**SMALL, gpus_per_node=n),
                         largest_group=G)
    # "auto" at stage 3 with the optimizer on NVMe: the paper's 2-byte shard, less itself
    assert p.buffer("param16").tiers == _tiers()
    assert p.estimate.params_from_master


def test_every_estimate_row_has_a_buffer_kind():
    """Every row the estimate writes over stages, offloads, ratios, dtypes and accumulation
    has a named kind: "other" (counted, never dropped) stays empty."""
    nvme = {"device": "nvme", "nvme_path": "/tmp/zeroio-placement-test"}
    for stage in (0, 1, 2, 3):
        for opt in ("none", "cpu", "nvme"):
            if stage == 0 and opt != "none":
                continue
            for par in (("none", "cpu", "nvme") if stage == 3 else ("none",)):
                for ratio in (1.0, 0.5):
                    if ratio < 1 and (opt == "none" or (opt == "nvme" and stage < 3)):
                        continue
                    for bf16, gas in ((True, 1), (True, 4), (False, 4)):
                        zero = {"stage": stage}
                        if opt != "none":
                            zero["offload_optimizer"] = {**nvme, "device": opt, "ratio": ratio}
                        if par != "none":
                            zero["offload_param"] = {**nvme, "device": par}
                        cfg = _cfg(zero, gas, world=2, bf16=bf16)
                        p = decide_placement(num_params=10**9, config=cfg, world_size=2,
                                             machine=MachineMemory(**SMALL, gpus_per_node=2),
                                             largest_group=G, activation_bytes=GB)
                        for t in ("gpu", "cpu", "nvme"):
                            assert p.tier_bytes(t) == p.estimate.per_gpu(t), (zero, t)
                        names = [i.name for i in p.estimate.items
                                 if buffer_of(i, p.estimate.stage)[0] == "other"
                                 and not i.name.startswith(("optimizer states", "optimizer "))]
                        assert names == [] and not any(p.buffer("other").tiers.values()), zero


def test_an_unknown_row_is_other_and_a_bad_machine_is_an_error():
    from zeroio.estimate import MemoryItem

    assert buffer_of(MemoryItem(name="mystery", tier="gpu", bytes_per_gpu=1,
                                kind="zeroio_buffer", formula="1"), 3) == ("other", "home")
    with pytest.raises(ConfigError, match="machine.gpu_bytes"):
        MachineMemory(gpu_bytes=-1, host_bytes=None, nvme_free_bytes=0)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        decide_placement(num_params=10, config=_cfg({"stage": 2}), world_size=3,
                         machine=MachineMemory(**SMALL, gpus_per_node=2))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("zero,gas", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, 4),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, 1),
    ({"stage": 1}, 2),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, 1),  # counted as stage 1 on one rank
])
def test_engine_reports_the_placement_the_function_decides(zero, gas):
    torch.manual_seed(0)
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = zeroio.initialize(model=_Net(), config=raw)
    try:
        for _ in range(gas):
            engine.backward(engine(torch.randn(2, 8)))
            engine.step()
        got = engine.stats()["placement"]
        psi = (8 * 16 + 16) + 3 * (16 * 16 + 16) + (16 * 4 + 4)  # counted by hand
        machine = MachineMemory(**got["machine"])
        assert machine.gpu_bytes == 0 and machine.gpu_free_bytes == 0  # a CPU device
        want = decide_placement(num_params=psi, config=load_config(raw, world_size=1),
                                world_size=1, machine=machine, largest_group=16 * 16 + 16,
                                device_type="cpu")
        assert got == want.to_dict()
        # fp32 training on one rank: 4-byte masters and 8 bytes of moments per parameter, on
        # the host with the optimizer offloaded, else on the (CPU) device
        tier = "cpu" if "offload_optimizer" in zero else "gpu"
        assert got["stage"] == zero["stage"] and got["accumulation_steps"] == gas
        assert got["buffers"]["master"]["tiers"][tier] == 4 * psi
        assert got["buffers"]["moments"]["tiers"][tier] == 8 * psi
    finally:
        engine.close()


MODEL = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 256, "max_position_embeddings": 2048, "tie_word_embeddings": False}
MACHINE = dict(gpus=1, host_bytes=256 * GB, disk_bytes=1000 * GB, pcie_bps=25 * GB,
               disk_read_bps=6 * GB, disk_write_bps=3 * GB, cpu_adam_elems_per_s=2 * GB)


@pytest.mark.parametrize("gpu_bytes,placement", [(80 * GB, "stage 2, all on the GPU"),
                                                 (12 * 10**6, "stage 3, optimizer on the CPU")])
def test_train_plan_json_shows_the_placement_the_engine_trains_with(tmp_path, capsys, gpu_bytes,
                                                                     placement):
    cfg, m = tmp_path / "config.json", tmp_path / "machine.json"
    cfg.write_text(json.dumps(MODEL))
    m.write_text(json.dumps({**MACHINE, "gpu_bytes": gpu_bytes}))
    rc = main(["train", "--steps", "2", "--seq-len", "64", "--micro-batch", "2", "--nproc", "1",
               "--no-checkpoint", "--output", str(tmp_path / "run"), "--model-config", str(cfg),
               "--machine", str(m), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads([ln for ln in out.out.splitlines() if ln.strip()][-1])
    planned = summary["plan"]["plan"]
    assert planned["placement"] == placement
    layout = planned["buffer_placement"]
    # the planner's decision, for the config it chose
    assert layout["stage"] == summary["stage"]
    assert layout["ratio"] == pytest.approx(summary["offload_optimizer_ratio"])
    assert layout["totals"]["gpu"] == planned["tiers"]["gpu"]["need_bytes"]
    # ... is the running engine's, buffer by buffer (the machine figures differ: measured; the
    # buckets are the run config's, reduce_bucket_size "auto" = hidden^2), all but the
    # activations: the planner's model of them (the engine counts none)
    engine = summary["placement"]
    state = [k for k in layout["buffers"] if k != "activations"]
    assert engine["buffers"]["comm"]["tiers"]["gpu"] > 0
    assert {k: engine["buffers"][k] for k in state} == {k: layout["buffers"][k] for k in state}
    assert engine["buffers"]["activations"]["tiers"]["gpu"] == 0
    assert layout["buffers"]["activations"]["tiers"]["gpu"] > 0
    assert engine["stage"] == layout["stage"] and engine["ratio"] == layout["ratio"]
    assert Path(tmp_path / "run" / "zeroio-plan.json").is_file()


def test_estimate_plan_prints_the_table(capsys):
    rc = main(["estimate", "--plan", "--params", "3B", "--gpus-per-node", "1", "--gpu-mem", "24",
               "--host-mem", "64", "--disk-free", "2000", "--pcie-gbps", "25",
               "--disk-read-gbps", "6", "--disk-write-gbps", "3", "--cpu-adam-gelems", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "placement per rank (stage 3, 1 rank(s), offload_optimizer cpu ratio 0.85" in text
    # the master row: 4 bytes per element; floor(0.15 x 3e9) elements stay on the GPU
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("master"))
    assert row.split()[1:4] == [f"{4 * 0.45:.3f}", f"{4 * 2.55:.3f}", "0.000"]


def test_masters_homed_on_nvme_have_a_host_window(monkeypatch):
    """The place left for masters paged through NVMe: a masters row on the nvme tier is the
    master's home there, a masters window row its pinned host window."""
    import dataclasses

    import zeroio.placement as mod
    from zeroio.estimate import MemoryItem

    real = mod.estimate_memory

    def paged(*a, **kw):
        est = real(*a, **kw)
        items = [i for i in est.items if "masters" not in i.name] + [
            MemoryItem(name="optimizer fp32 masters", tier="nvme", bytes_per_gpu=4 * GB,
                       kind="model_state", formula="4 * Psi / N"),
            MemoryItem(name="optimizer master window (pinned)", tier="cpu",
                       bytes_per_gpu=GB // 2, kind="zeroio_buffer", formula="window")]
        return dataclasses.replace(est, items=tuple(items))

    monkeypatch.setattr(mod, "estimate_memory", paged)
    nvme = {"device": "nvme", "nvme_path": "/tmp/zeroio-placement-test"}
    p = decide_placement(num_params=10**9, config=_cfg({"stage": 3, "offload_optimizer": nvme}),
                         world_size=1, machine=MachineMemory(**SMALL), largest_group=G)
    master = p.buffer("master")
    assert master.tiers == _tiers(nvme=4 * GB) and master.window_bytes == GB // 2
    assert p.tier_bytes("cpu") == p.estimate.per_gpu("cpu")
