"""Masters and gradients paged through NVMe on CUDA (stage 3, bf16, parameters on NVMe): the
landing's copies into pinned gradient windows on the ``d2h`` stream, the event each full
piece waits for before its write-behind, and the 16-bit gradient the one-pass CPU Adam reads
([Note: paged gradients] in zeroio/shard/paged_grads.py).

References: the same engine with host masters and host gradients on the same GPU (losses and
final weights bit for bit), and the swap plan's bytes (each timed step moves, each way, at
most what the plan streams and more than the moments alone).

Run on the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_nvme_paged_gpu.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda

pytestmark = pytest.mark.gpu

BATCH, STEPS = 4, 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))


def _config(world: int, nvme: str, masters: str, budget: int) -> dict:
    nv = {"device": "nvme", "nvme_path": nvme}
    return {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "sub_group_size": 1024,
                                  "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {**nv, "masters": masters},
                                  "offload_param": {**nv, "max_in_cpu": 0},
                                  "tiering": {"cpu_budget_bytes": budget}}}


def _phase(root):
    import torch.distributed as dist

    import zeroio

    device = exact_cuda_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    out = {}
    for masters, budget in (("host", 1 << 24), ("nvme", 60_000)):
        engine, *_ = zeroio.initialize(
            model=_model(), config=_config(world, os.path.join(root, f"{masters}{rank}"), masters,
                                           budget))
        opt, losses, moved = engine.optimizer, [], []
        for i in range(STEPS):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 32, generator=g)
            x, y = (t[rank * per:(rank + 1) * per].to(device) for t in (x, y))
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            opt.drain()
            moved.append(dict(opt.store.stats()["bytes_moved"]))
        masters_now = [opt.local_tensor(g.group_index, "fp32").cpu().numpy().copy()
                       for g in engine.partitioner.groups]
        out[masters] = {"losses": losses, "masters": masters_now,
                        "kinds": engine.stats()["sources"]["optimizer"]["swap_plan"]["kinds"],
                        "streamed": opt.plan.streamed_bytes,
                        "moved": [{k: b.get(k, 0) - a.get(k, 0) for k in ("nvme->cpu",
                                                                           "cpu->nvme")}
                                  for a, b in zip(moved, moved[1:], strict=False)]}
        engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_paged_masters_and_gradients_on_cuda_equal_host_masters(tmp_path, world):
    need_cuda(world)
    for r in run_ranks(_phase, world, str(tmp_path), backend="nccl", timeout=600):
        assert r["nvme"]["kinds"] == ["master", "grad", "exp_avg", "exp_avg_sq"]
        assert r["nvme"]["losses"] == r["host"]["losses"]
        for a, b in zip(r["nvme"]["masters"], r["host"]["masters"], strict=True):
            assert np.array_equal(a, b)
        streamed = r["nvme"]["streamed"]
        assert streamed > 0
        for moved in r["nvme"]["moved"]:
            for way in ("nvme->cpu", "cpu->nvme"):
                assert streamed * 8 // 14 < moved[way] <= streamed, (moved, streamed)
