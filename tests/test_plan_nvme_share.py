"""The planner on one H200 machine (143,771 MiB GPU, 125.9 GiB host, 62 GB free disk): a 20B
Llama needs the GPU share of the optimizer state with NVMe, params_from_master and the
resident head of moments in host memory; hand computations of every tier's bytes."""

from __future__ import annotations

import json
import math
import re

import pytest

from zeroio.cli.main import main
from zeroio.errors import CapacityError
from zeroio.plan import MARGIN, Machine, plan_placement

MIB, GIB, GB = 1 << 20, 1 << 30, 10**9
H200 = dict(gpus=1, gpu_bytes=143_771 * MIB, host_bytes=int(125.9 * GIB), disk_bytes=62 * GB,
            pcie_bps=54 * GB, disk_read_bps=1.7 * GB, disk_write_bps=1.9 * GB,
            cpu_adam_elems_per_s=0.8 * GB)
HID, INTER, VOCAB, LAYERS = 6144, 16384, 32000, 43
LAYER = 4 * HID * HID + 3 * HID * INTER + 2 * HID  # q/k/v/o, gated MLP, two norms
PSI = LAYERS * LAYER + 2 * VOCAB * HID + HID  # 19,872,098,304: "20B"
SHAPE = dict(layers=LAYERS, hidden=HID, vocab=VOCAB, intermediate=INTER)


@pytest.fixture(autouse=True)
def _auto_cpu_adam(monkeypatch):
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)  # 16-bit host gradients (auto)


def _plan(machine: Machine, psi: int = PSI, **shape):
    return plan_placement(psi, machine, micro_batch=1, seq=512, params_from_master=True,
                          **(shape or SHAPE))


def _gpu_bytes(dev: int, host: int) -> int:
    """Stage 3 GPU bytes with D optimizer elements on the GPU, by hand (bf16, one rank)."""
    live = 10**9 + LAYER  # stage3_max_live_parameters + the group in use
    act = 512 * (LAYERS * (30 * HID + 6 * INTER) + 10 * VOCAB)
    # per GPU-side element: master 4, moments 8, gradient 2 + fp32 rest 2; no 16-bit shard
    return (16 * dev + 2 * 4 * LAYER + 2 * LAYER + 2 * live + 4 * min(live, host) + act)


def test_h200_places_a_20b_llama_with_all_three_tiers_holding_optimizer_state():
    assert PSI == 19_872_098_304
    m = Machine(**H200)
    plan = _plan(m)
    assert plan.placement == "stage 3, optimizer on NVMe" and plan.ratio == 0.64
    assert plan.params_from_master
    dev = math.floor(PSI * (1 - 0.64))
    host = PSI - dev
    gpu_usable = int(m.gpu_bytes * (1 - MARGIN))
    assert _gpu_bytes(dev, host) == plan.tiers[0].need_bytes <= gpu_usable
    more = math.floor(PSI * (1 - 0.63))  # one more percent on the GPU does not fit
    assert _gpu_bytes(more, PSI - more) > gpu_usable
    # host: fp32 master 4 + 16-bit gradient 2 per host element, the swap window (4 pieces of
    # 2^24 elements' two fp32 moments), then whole pieces of moments resident
    budget = int(m.host_bytes * (1 - MARGIN))
    pair = 2 * 4 * (1 << 24)
    resident = (budget - 6 * host - 4 * pair) // pair * pair
    assert plan.tiers[1].need_bytes == 6 * host + 4 * pair + resident <= budget
    # disk: only the moments the host does not keep
    disk_usable = 62 * GB - GIB
    assert plan.tiers[2].need_bytes == 8 * host - resident <= disk_usable
    assert plan.resident_moment_bytes == resident
    zero = plan.config["zero_optimization"]
    assert zero["offload_optimizer"]["ratio"] == 0.64 and zero["stage"] == 3
    assert zero["tiering"]["cpu_budget_bytes"] == budget
    assert zero["tiering"]["nvme_budget_bytes"] == disk_usable
    # bytes per step: 16-bit gradients down, the host masters in (4 bytes, forward and
    # backward), each streamed moment read and written once
    streamed = 8 * host - resident
    assert plan.traffic == {"gpu->cpu": 2 * host, "cpu->gpu": 2 * 4 * host,
                            "nvme->cpu": streamed, "cpu->nvme": streamed}
    assert plan.times == pytest.approx({
        "cpu_adam_s": host / m.cpu_adam_elems_per_s, "pcie_s": 8 * host / m.pcie_bps,
        "disk_s": streamed / m.disk_read_bps + streamed / m.disk_write_bps})
    assert plan.bound == "pcie_s + disk_s"
    assert plan.step_s == pytest.approx(plan.times["pcie_s"] + plan.times["disk_s"])


def test_a_machine_ten_percent_smaller_is_refused_naming_each_tier_overflow():
    small = Machine(**{**H200, **{k: int(H200[k] * 0.9) for k in
                                  ("gpu_bytes", "host_bytes", "disk_bytes")}})
    with pytest.raises(CapacityError) as err:
        _plan(small)
    msg = str(err.value)
    last = msg.split("the most offloaded one, ")[1]
    assert last.startswith("stage 3, optimizer and parameters on NVMe at offload_optimizer.ratio")
    pattern = (r"(GPU memory|host memory|disk under the NVMe path)[^;:]*? overflows by "
               r"([\d,]+) bytes \(([\d.]+) GB needed, ([\d.]+) GB usable")
    over = {t: (int(n.replace(",", "")), float(a), float(b))
            for t, n, a, b in re.findall(pattern, last)}
    assert "disk under the NVMe path" in over
    for _tier, (nbytes, need, usable) in over.items():
        assert nbytes > 0 and abs(nbytes / GB - (need - usable)) < 0.02
    # the disk figure by hand: 8 bytes per host element less what 0.9 x host keeps resident
    disk = over["disk under the NVMe path"]
    assert disk[2] == pytest.approx((int(62 * GB * 0.9) - GIB) / GB, abs=0.01)


@pytest.mark.parametrize("shape, psi, placement", [
    (dict(layers=24, hidden=2048, vocab=32000, intermediate=5632), 1_364_297_728,
     "stage 2, all on the GPU"),
    (dict(layers=32, hidden=4096, vocab=32000, intermediate=11008), 6_738_415_616,
     "stage 3, all on the GPU"),
])
def test_smaller_llamas_keep_their_placement_on_that_machine(shape, psi, placement):
    plan = _plan(Machine(**H200), psi, **shape)
    assert plan.placement == placement and plan.ratio == 1.0
    assert plan.config["zero_optimization"] == {"stage": int(placement[6]),
                                                "sub_group_size": 10**9}
    assert not plan.params_from_master


def test_cli_prints_the_same_plan(tmp_path, capsys):
    mfile = tmp_path / "machine.json"
    mfile.write_text(json.dumps(Machine(**H200).to_dict()))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": HID, "intermediate_size": INTER,
                               "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
                               "num_attention_heads": 48}))
    args = ["estimate", "--plan", "--model-config", str(cfg), "--machine", str(mfile),
            "--micro-batch", "1", "--seq", "512", "--params-from-master", "true"]
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = json.loads(json.dumps(_plan(Machine(**H200)).to_dict()))
    got.pop("model")
    assert got == want
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "plan: stage 3, optimizer on NVMe (offload_optimizer.ratio 0.64)" in text
    assert '"nvme_budget_bytes": 60926258176' in text and "params_from_master" in text
