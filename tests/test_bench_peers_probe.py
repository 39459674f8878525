"""probe_largest.py's size logic: parameter counts, placement against the estimate, depth stepping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_largest as P  # noqa: E402


def test_llama_params_matches_llama2_7b():
    # Llama-2-7B (4096 wide, 32 layers, 11008, vocab 32000, untied): 6,738,415,616 parameters
    assert P.llama_params(32) == 6_738_415_616
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert P.llama_params(33) - P.llama_params(32) == per_layer


def test_needs_by_hand():
    psi = 5_000_000_000  # above DeepSpeed's default buckets, so those are capped
    gpu = 2 * 2 * 500_000_000 + 2 * 1_000_000_000  # two reduce buckets + live params (bf16)
    # the fp32 model (4 per param) is on the GPU while the shards are built, then leaves it
    # ([Note: host memory beyond the estimate]): the host needs max(build, state)
    init = 4 * psi
    assert P.needs(psi, ("cpu", "cpu")) == {"gpu": init, "host": 20 * psi, "disk": 0}
    # params 2 + bf16 grads 2 + fp32 grads 4 (per param), and 4 pinned optimizer swap
    # buffers of sub_group_size (1e9) fp32 values
    assert P.needs(psi, ("cpu", "nvme")) == {"gpu": init, "host": 8 * psi + 16_000_000_000,
                                             "disk": 12 * psi}
    # + 5 parameter swap buffers of 1e8 bf16 values; params move to the disk
    assert P.needs(psi, ("nvme", "nvme")) == {
        "gpu": init, "host": 6 * psi + 17_000_000_000, "disk": 14 * psi}
    # ratio 0.5: 2.5e9 elements keep 12 (optimizer) + 2 + 4 (gradients) bytes on the GPU
    dev = psi // 2
    assert P.needs(psi, ("cpu", "cpu"), 0.5) == {"gpu": gpu + 18 * dev,
                                                 "host": 2 * psi + 18 * (psi - dev), "disk": 0}


def test_placement_picks_cheapest_that_fits():
    psi, big = 5_000_000_000, 10**15
    assert P.placement_for(psi, P.Capacity(gpu=big, host=100 * 10**9, disk=0)) == ("cpu", "cpu")
    cap = P.Capacity(gpu=big, host=99 * 10**9, disk=60 * 10**9)
    assert P.placement_for(psi, cap) == ("cpu", "nvme")
    cap = P.Capacity(gpu=big, host=56 * 10**9 - 1, disk=70 * 10**9)
    assert P.placement_for(psi, cap) == ("nvme", "nvme")
    assert P.placement_for(psi, P.Capacity(gpu=big, host=46 * 10**9, disk=big)) is None
    assert P.placement_for(psi, P.Capacity(gpu=3 * 10**9, host=big, disk=big)) is None


def test_plan_takes_the_smallest_ratio_the_gpu_holds():
    psi = 5_000_000_000
    gpu = 4 * 10**9 + 18 * psi // 2  # exactly ratio 0.5's device side
    cap = P.Capacity(gpu=gpu, host=99 * 10**9, disk=0)
    assert P.placement_for(psi, cap) is None  # ratio 1: 100e9 of host state does not fit
    assert P.plan_for(psi, cap) == P.Plan(param="cpu", optimizer="cpu", ratio=0.5)
    assert P.plan_for(psi, P.Capacity(gpu=gpu - 1, host=99 * 10**9, disk=0)).ratio == 0.51
    cfg = P.probe_config(("cpu", "cpu"), Path("/x"), 1, ratio=0.5)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True,
                                                             "ratio": 0.5}


def test_largest_fitting_layers_is_the_last_that_fits():
    cap = P.Capacity(gpu=10**15, host=20 * P.llama_params(10), disk=0)  # cpu/cpu up to 10 layers
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
