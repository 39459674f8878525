"""``tiering.params_from_master`` on CUDA: the H2D copy of the master and its cast, ordered
against the overlapped host step, the device side of ``offload_optimizer.ratio`` and the
gathers ([Note: shards read from the master] in partition/stage3/master_store.py).

Every case trains the tiny tied Llama twice, option off and on (step assist off in both),
and requires the same losses, gathered parameters and fp32 masters bit for bit. In the on run every
``MasterShards.fetch`` first spins its ``h2d`` stream for ~10 ms, so a reader that does not
wait on the fetch's event (the gather) or a writer of the master that does not wait for the
copies still reading it (the CPU Adam of the next step, the device step) sees other values.

Run on the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_params_from_master_gpu.py
"""

from __future__ import annotations

import os

import pytest
import test_params_from_master as cpu  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.models import token_batches
from zeroio.testing.training import train_llama

pytestmark = pytest.mark.gpu

CASES = [  # (offload_param, offload_optimizer, dtype, ratio, overlap_step)
    ("cpu", "cpu", "bf16", None, True), ("cpu", "cpu", "bf16", 0.5, True),
    ("none", "cpu", "bf16", 0.5, False), ("cpu", "nvme", "bf16", None, True),
    ("none", "none", "bf16", None, True), ("cpu", "cpu", "fp32", None, True),
    ("nvme", "nvme", "bf16", None, True),  # no NVMe home for the sharded 16-bit shards
]


def _delay_fetches() -> None:
    import torch

    from zeroio.partition.stage3.master_store import MasterShards

    fetch = MasterShards.fetch

    def slow(self, key, streams):
        if streams.h2d is not None:
            with torch.cuda.stream(streams.h2d):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles before the copies
        return fetch(self, key, streams)

    MasterShards.fetch = slow


def _body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device()
    _delay_fetches()
    init = cpu._init()
    batches = token_batches(world, steps=cpu.STEPS, gas=cpu.GAS, micro=cpu.MICRO)
    out = []
    for i, (op, oo, dtype, ratio, overlap) in enumerate(CASES):
        runs = {}
        for on in (False, True):
            cfg = cpu._config(op, oo, dtype, os.path.join(tmpdir, f"c{i}-{on}-r{rank}"), on=on,
                              ratio=ratio)
            # the step assist (off with the option) steps chunks with torch's fused Adam, equal
            # to the CPU Adam to float32 rounding only: off in both runs
            cfg["zero_optimization"]["tiering"].update(overlap_step=overlap, step_assist=False)
            losses, params, masters, kind = train_llama(batches, init, cfg, device=device,
                                                        inspect=cpu._store_kind)
            runs[on] = (losses, cpu._bytes(params), cpu._bytes(masters), kind)
        out.append(((op, oo, dtype, ratio, overlap), runs))
    return out


def test_one_gpu(tmp_path):
    need_cuda(1)
    results = run_ranks(_body, 1, str(tmp_path), backend="nccl", timeout=500)
    assert len(results) == 1 and all(results), results  # one list of cases per rank
    cpu._check_training(results)  # asserts on == off per case


def test_two_gpus_nccl(tmp_path):
    need_cuda(2)
    results = run_ranks(_body, 2, str(tmp_path), backend="nccl", timeout=500)
    assert len(results) == 2 and all(results), results  # one list of cases per rank
    cpu._check_training(results)  # asserts on == off per case
