"""probe_largest.py's size logic: parameter counts, placement against the estimate, depth stepping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_largest as P  # noqa: E402


@pytest.fixture(autouse=True)
def _fp32_host_gradients(monkeypatch):
    """The hand counts below are for torch's CPU Adam (fp32 host gradients);
    test_needs_with_16bit_host_gradients sets the one-pass kernel's mode itself."""
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")


def test_llama_params_matches_llama2_7b():
    # Llama-2-7B (4096 wide, 32 layers, 11008, vocab 32000, untied): 6,738,415,616 parameters
    assert P.llama_params(32) == 6_738_415_616
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert P.llama_params(33) - P.llama_params(32) == per_layer


def test_needs_by_hand():
    psi = 5_000_000_000  # above DeepSpeed's default buckets, so those are capped
    # no shape: reduce_bucket_size (5e8) stands in for the largest group G; two fp32 group
    # buckets + bf16 autograd gradients of one group + live params (max_live 1e9 + G) and, with
    # offload_param, their shards copied in; plus GPU_BASELINE
    gpu = 2 * 4 * 500_000_000 + 2 * 500_000_000 + 2 * 2 * 1_500_000_000 + P.GPU_BASELINE
    base = P.HOST_BASELINE
    # bf16 shards 2 + fp32 master 4 + moments 8 + fp32 gradient 4 (no bf16 gradient shard);
    # the zero.Init build (bf16 init shards 2 + host shards 2 + masters and gradients 8) is less
    # optimizer on cpu: the step assist's 4 GPU slots of 16M elements (fp32 master, moments,
    # gradient, and the bf16 copy bound for the host shard)
    assist = 4 * (1 << 24) * (16 + 2)
    assert P.needs(psi, ("cpu", "cpu")) == {"gpu": gpu + assist, "host": 18 * psi + base,
                                            "disk": 0}
    # nvme optimizer: masters stay on the host (4), moments (8) on the disk, 4 pinned swap
    # buffers of sub_group_size (1e9) fp32 values
    assert P.needs(psi, ("cpu", "nvme")) == {"gpu": gpu, "host": 10 * psi + 16 * 10**9 + base,
                                             "disk": 8 * psi}
    # + 5 parameter swap buffers of 1e8 bf16 values; params move to the disk but for
    # offload_param.max_in_cpu (DeepSpeed's default 1e9 elements) of bf16 shards kept in host
    # memory
    kept = 2 * 10**9
    assert P.needs(psi, ("nvme", "nvme")) == {
        "gpu": gpu, "host": 8 * psi + 17 * 10**9 + kept + base, "disk": 10 * psi - kept}
    # ratio 0.5: 2.5e9 elements keep 12 (optimizer) + 4 (fp32 gradient) bytes on the GPU, with
    # the staging buffer of the device side's bf16 publish (2^26 bf16)
    dev = psi // 2
    assert P.needs(psi, ("cpu", "cpu"), 0.5) == {"gpu": gpu + 16 * dev + 2 * (1 << 26) + assist,
                                                 "host": 2 * psi + 16 * (psi - dev) + base,
                                                 "disk": 0}
    # with the shape: a decoder layer is the largest group, activations on the GPU
    shape = P.Shape(hidden=64, intermediate=128, vocab=100, layers=2, seq=8, micro_batch=2)
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    n = P.llama_params(2, 64, 128, 100)
    acts = 16 * (2 * (30 * 64 + 6 * 128) + 10 * 100)
    got = P.needs(n, ("cpu", "cpu"), 1.0, shape)
    assert got["gpu"] == (2 * 4 * layer + 2 * layer + 2 * 2 * n + acts + P.GPU_BASELINE
                          + 4 * n * (16 + 2))  # assist slots as large as the host state
    assert got["host"] == 18 * n + base


def test_needs_with_16bit_host_gradients(monkeypatch):
    """Under the one-pass CPU Adam (auto, the default, for >= 16M host elements) stage 3's host
    gradient shard is bf16: 2 bytes per host element instead of 4, on the host only."""
    psi, base = 5_000_000_000, P.HOST_BASELINE
    fp32 = P.needs(psi, ("cpu", "cpu"), 0.5)
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "auto")
    got = P.needs(psi, ("cpu", "cpu"), 0.5)
    host_side = psi - psi // 2
    assert got["host"] == 2 * psi + (12 + 2) * host_side + base
    assert fp32["host"] - got["host"] == 2 * host_side
    # the device side keeps fp32 gradients; the step assist's slots hold the bf16 host
    # gradient too (4 slots of 16M elements)
    assert got["gpu"] == fp32["gpu"] + 4 * (1 << 24) * 2
    # an NVMe optimizer takes the 16-bit host gradient too (the one-pass kernel reads it):
    # 2 (gradient) + 4 (masters) + 2 (16-bit parameters) bytes per element on the host
    assert P.needs(psi, ("cpu", "nvme"))["host"] == 8 * psi + 16 * 10**9 + base


def test_placement_picks_cheapest_that_fits():
    psi, big = 5_000_000_000, 10**15
    assert P.placement_for(psi, P.Capacity(gpu=big, host=93 * 10**9, disk=0)) == ("cpu", "cpu")
    cap = P.Capacity(gpu=big, host=93 * 10**9 - 1, disk=40 * 10**9)
    assert P.placement_for(psi, cap) == ("cpu", "nvme")
    cap = P.Capacity(gpu=big, host=69 * 10**9 - 1, disk=50 * 10**9)
    assert P.placement_for(psi, cap) == ("nvme", "nvme")
    assert P.placement_for(psi, P.Capacity(gpu=big, host=60 * 10**9 - 1, disk=big)) is None
    assert P.placement_for(psi, P.Capacity(gpu=3 * 10**9, host=big, disk=big)) is None


def test_plan_takes_the_smallest_ratio_the_gpu_holds():
    psi = 5_000_000_000
    gpu = P.needs(psi, ("cpu", "cpu"))["gpu"] + 16 * psi // 2 + 2 * (1 << 26)  # ratio 0.5's
    cap = P.Capacity(gpu=gpu, host=92 * 10**9, disk=0)
    assert P.placement_for(psi, cap) is None  # ratio 1: 93e9 of host state does not fit
    assert P.plan_for(psi, cap) == P.Plan(param="cpu", optimizer="cpu", ratio=0.5)
    assert P.plan_for(psi, P.Capacity(gpu=gpu - 1, host=92 * 10**9, disk=0)).ratio == 0.51
    cfg = P.probe_config(("cpu", "cpu"), Path("/x"), 1, ratio=0.5)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True,
                                                             "ratio": 0.5}


def test_largest_fitting_layers_is_the_last_that_fits():
    host = 18 * P.llama_params(10) + P.HOST_BASELINE  # cpu/cpu up to 10 layers
    cap = P.Capacity(gpu=10**15, host=host, disk=0)
    assert P.largest_fitting_layers(cap) == 10
    assert P.placement_for(P.llama_params(11), cap) is None


@pytest.mark.parametrize("history, expected", [
    ([], 40),
    ([(40, True)], 48),
    ([(40, True), (48, True)], 56),
    ([(40, True), (48, False)], None),  # bracketed: 40 trains, 48 does not
    ([(40, False)], 32),
    ([(40, False), (32, False)], 24),
    ([(40, False), (32, True)], None),
    ([(40, False), (32, False), (24, False), (16, False), (8, False)], None),  # nothing left
])
def test_next_layers(history, expected):
    assert P.next_layers(history, start=40, step=8) == expected


def test_probe_config_puts_state_where_asked(tmp_path):
    cfg = P.probe_config(("nvme", "cpu"), tmp_path, micro_batch=1)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["nvme_path"] == str(tmp_path / "param")
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
