"""`zeroio train --grad-accum N`: N micro-steps per optimizer step.

On one rank the data order deals the same sequences to a step of ``--micro-batch 2`` and to the
two micro-steps of ``--micro-batch 1 --grad-accum 2`` (data.py, [Note: resumable order]); every
sequence has the same number of tokens, so the mean of the two micro-steps' mean losses is the
big batch's mean loss, and the two runs must train the same model. The planner counts the
accumulation's host gradients, staging and traffic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from zeroio.errors import ConfigError
from zeroio.testing.train_cli import run_train

ARGS = ["--steps", "3", "--seq-len", "32", "--nproc", "1", "--json", "--no-checkpoint"]


def _train(out: Path, *extra: str) -> dict:
    return run_train(out, [*ARGS, *extra], os.environ)


@pytest.mark.slow
def test_two_micro_steps_train_the_model_of_one_twice_as_large(tmp_path):
    from safetensors.torch import load_file

    big = _train(tmp_path / "big", "--micro-batch", "2")
    acc = _train(tmp_path / "acc", "--micro-batch", "1", "--grad-accum", "2")
    assert len(acc["losses"]) == 3
    assert acc["losses"] == pytest.approx(big["losses"], rel=1e-5)
    # tokens per step: micro batch x accumulation x ranks x seq, 2 x 32 in both
    for run in (big, acc):
        assert run["tokens_per_s"] * run["wall_s"] == pytest.approx(3 * 2 * 32)
    _train(tmp_path / "still", "--micro-batch", "2", "--lr", "0")  # the initial weights

    def weights(name):
        return {k: v for f in sorted((tmp_path / name / "model").glob("*.safetensors"))
                for k, v in load_file(f).items()}

    got, want, start = weights("acc"), weights("big"), weights("still")
    assert got.keys() == want.keys() == start.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    # and the steps did move them (Adam's first steps move each weight by about the lr)
    moved = max(float((got[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-3, moved


def test_grad_accum_checked_and_config_contradiction_named(tmp_path):
    from zeroio.cli.train.loop import TrainOptions, check_options, resolve_config
    from zeroio.cli.train.presets import llama_config

    with pytest.raises(ConfigError, match="--grad-accum must be >= 1, got 0"):
        check_options(TrainOptions(grad_accum=0))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"stage": 2}}))
    mcfg = llama_config("tiny", None)
    typed = TrainOptions(config=str(cfg), grad_accum=2, given=frozenset({"grad_accum"}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        resolve_config(typed, mcfg, world_size=1, cuda=False, out=tmp_path)
    # not typed: the config's value stands; typed and equal: no contradiction
    assert resolve_config(TrainOptions(config=str(cfg)), mcfg, world_size=1, cuda=False,
                          out=tmp_path).gradient_accumulation_steps == 4
    same = TrainOptions(config=str(cfg), grad_accum=4, given=frozenset({"grad_accum"}))
    assert resolve_config(same, mcfg, world_size=1, cuda=False,
                          out=tmp_path).gradient_accumulation_steps == 4
    # with the built-in config the flag sets it
    assert resolve_config(TrainOptions(grad_accum=3), mcfg, world_size=2, cuda=False,
                          out=tmp_path).train_batch_size == 4 * 3 * 2


def test_plan_counts_the_accumulation():
    """15.24B on an H200 machine's figures: with 16 micro-steps the host gradient is fp32 (no
    16-bit shard while it accumulates), so 4 - 2 more bytes per host element push that many
    moments out of the host budget to the disk; the staging is 3 slots of one layer's slice;
    gradients and parameter copies cross PCIe once per micro-step."""
    from zeroio.plan import Machine, plan_placement

    m = Machine(gpus=1, gpu_bytes=149_560_000_000, host_bytes=133_690_000_000,
                disk_bytes=68_640_000_000, pcie_bps=52.55e9, disk_read_bps=1.83e9,
                disk_write_bps=2.18e9, cpu_adam_elems_per_s=3.9e9, disk_mixed_bps=1.3e9)
    shape = dict(micro_batch=1, seq=1024, layers=47, hidden=5120, vocab=32000, intermediate=13824)
    one = plan_placement(15.24e9, m, **shape)
    acc = plan_placement(15.24e9, m, **shape, accumulation=16)
    assert one.placement == acc.placement == "stage 3, optimizer on NVMe"
    assert one.ratio == acc.ratio
    host = one.estimate.placement()["offloaded_elements_per_gpu"]
    items = {i.name: i.bytes_per_gpu for i in acc.estimate.items if i.tier == "cpu"}
    layer = 4 * 5120 ** 2 + 3 * 5120 * 13824 + 2 * 5120  # one decoder layer's parameters
    assert items["gradient accumulation staging (pinned fp32)"] == 4 * 3 * layer
    assert items["fp32 gradient shard beyond the model states'"] == 2 * host
    def held(plan):  # host bytes beside the moments and their swap window
        return sum(i.bytes_per_gpu for i in plan.estimate.items if i.tier == "cpu" and
                   not i.name.startswith(("optimizer moments", "optimizer swap")))

    extra = 2 * host + 4 * 3 * layer
    assert held(acc) - held(one) == extra
    # one micro-step: every host-side moment (8 bytes per element) stays resident in the host
    # budget, no swap window; with 16 the budget left after the larger state, less the swap
    # window (the piece being updated and 3 read ahead, of 2^24 elements' two fp32 moments),
    # holds fewer whole pieces, and the rest go to the disk and back, once each per step
    budget = acc.config["zero_optimization"]["tiering"]["cpu_budget_bytes"]
    assert one.resident_moment_bytes == 8 * host and one.traffic["nvme->cpu"] == 0
    assert one.tiers[1].need_bytes == held(one) + 8 * host <= budget
    pair = 2 * 4 * (1 << 24)
    resident = (budget - held(acc) - 4 * pair) // pair * pair
    assert acc.resident_moment_bytes == resident
    assert acc.tiers[1].need_bytes == held(acc) + 4 * pair + resident <= budget
    assert acc.traffic["nvme->cpu"] == acc.traffic["cpu->nvme"] == 8 * host - resident
    # params_from_master: the fp32 masters cross twice per micro-step; the fp32 gradients once
    assert acc.traffic["cpu->gpu"] == 16 * one.traffic["cpu->gpu"] == 16 * 2 * 4 * host
    assert acc.traffic["gpu->cpu"] == 16 * 4 * host and one.traffic["gpu->cpu"] == 2 * host
    with pytest.raises(ConfigError, match="accumulation = 0"):
        plan_placement(15.24e9, m, **shape, accumulation=0)


def test_the_plan_places_the_accumulation_buffer_where_the_engine_would():
    """The Llama-3-8B shape on the H200 machine's figures at micro batch 1, seq 2048. With 8
    micro-steps the planner gives each candidate the GPU memory it may use as the device room
    (the engine's measured free memory), so the rule of config/accum_place.py places the fp32
    accumulation buffer on the GPU when it fits half of what the GPU model states leave, less
    the 2 GiB reserve: then it is the gradient's home, the host step reads it through its
    window (2 slots of one 64M-element chunk, 2 bytes each: one micro step's rule), no host
    gradient shard exists, nothing is staged on the host, the gradient crosses PCIe once per
    step, and the optimizer stays on the CPU (the host path's fp32 gradient sent it to
    NVMe)."""
    from zeroio.config.accum_place import ACCUM_RESERVE_BYTES, ACCUM_ROW, WINDOW_ROW
    from zeroio.plan import MARGIN, Machine, plan_placement

    m = Machine(gpus=1, gpu_bytes=149_560_000_000, host_bytes=133_690_000_000,
                disk_bytes=68_640_000_000, pcie_bps=52.55e9, disk_read_bps=1.83e9,
                disk_write_bps=2.18e9, cpu_adam_elems_per_s=3.9e9, disk_mixed_bps=1.3e9)
    shape = dict(micro_batch=1, seq=2048, layers=32, hidden=4096, vocab=128256,
                 intermediate=14336)
    plan = plan_placement(8.03e9, m, **shape, accumulation=8)
    assert plan.placement == "stage 3, optimizer on the CPU"
    host = plan.estimate.placement()["offloaded_elements_per_gpu"]
    rows = {i.name: (i.tier, i.bytes_per_gpu) for i in plan.estimate.items}
    assert rows[ACCUM_ROW] == ("gpu", 4 * host)
    # the rule by hand: half of the usable GPU memory the model states leave, less the reserve
    states = sum(i.bytes_per_gpu for i in plan.estimate.items
                 if i.tier == "gpu" and i.kind == "model_state")
    assert 4 * host <= (int(m.gpu_bytes * (1 - MARGIN)) - states) // 2 - ACCUM_RESERVE_BYTES
    assert "gradients" not in rows and rows[WINDOW_ROW] == ("cpu", 2 * (1 << 26) * 2)
    assert not any("staging" in name for name in rows)
    assert plan.traffic["gpu->cpu"] == 2 * host  # once per step, not once per micro step
