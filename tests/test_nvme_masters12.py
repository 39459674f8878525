"""Masters paged through NVMe at stages 1 and 2 ([Note: stage 1/2 paged masters] in
zeroio/partition/stage12_paged.py; [Note: where the masters live] in zeroio/optim/swap.py).

References: plain torch AdamW on an unpartitioned copy of the model (losses and final weights
within fp32 tolerance), zeroio's own run with host masters at the same stage (bit for bit), the
optimizer store's byte counters against the swap plan's arithmetic (every streamed piece's
master and both moments through the disk each step), an uninterrupted run for a checkpoint
round trip. The model, batches and torch reference are test_nvme_masters.py's, which also
runs the step whose first window's master read fails at stages 1 and 2.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_nvme_masters import (
    HOST_BUDGET,
    _batch,
    _iteration,
    _masters,
    _model,
    _params,
    assert_streamed_and_exact,
)

from zeroio.testing import run_ranks

STEPS = 5
BUDGET = {1: 180_000, 2: 170_000}
"""Per rank: the replica and its gradient buffer (fp32, on the CPU "device" here: ~50 KB each)
and the gradient shard stay in host memory; the optimizer's share is below its masters +
moments (~150 KB / world). The runs ask for "nvme": on a CPU device the replica and its
gradient buffer take host memory too, so no feasible budget here is below the "auto" threshold
(``MASTERS_ROOM`` x masters + gradient: tests/test_nvme_masters.py tests the rule)."""
MASTERS = {1: "nvme", 2: "nvme"}


def _engine(stage: int, world: int, nvme: str, masters: str = "auto", budget: int | None = None,
            rule: str = "AdamW", bf16: bool = False):
    import zeroio

    cfg = {
        "train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
        "optimizer": {"type": rule, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "sub_group_size": 1024,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                                    "masters": masters},
                              "tiering": {"cpu_budget_bytes": BUDGET[world] if budget is None
                                          else budget}},
    }
    if bf16:  # 16-bit replica: each master piece is cast as it is published
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zeroio.initialize(model=_model(), config=cfg)
    engine.show_progress = False
    return engine


def _training_phase(root, stage):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    host = _engine(stage, world, os.path.join(root, f"host{rank}"), "host", HOST_BUDGET)
    host_losses = [_iteration(host, i) for i in range(STEPS)]
    host_params, host_masters = _params(host), _masters(host)
    host.close()

    nvme = os.path.join(root, f"nvme{rank}")
    e = _engine(stage, world, nvme, MASTERS[world])
    opt = e.optimizer
    moved, losses = [], []
    for i in range(STEPS):
        losses.append(_iteration(e, i))
        opt.drain()
        moved.append(dict(opt.store.stats()["bytes_moved"]))
    streamed = list(opt.pieces[opt.plan.resident:])
    out = {
        "paged": e.partitioner.paged is not None, "kinds": list(opt._kinds),
        "meta_masters": all(g.master.is_meta for g in e.partitioner.groups),
        "spill_left": sorted(n for n in os.listdir(nvme) if n.startswith("zeroio-masters-init")),
        "per_step": [{k: b.get(k, 0) - a.get(k, 0) for k in ("nvme->cpu", "cpu->nvme")}
                     for a, b in zip(moved, moved[1:], strict=False)],
        "streamed_bytes": opt.plan.streamed_bytes,
        "report": e.stats()["sources"]["optimizer"]["swap_plan"],
        "resident": opt.plan.resident, "n_pieces": len(opt.pieces),
        "streamed_by_hand": sum(p.numel * 12 for p in streamed),
        "largest_piece": max((p.numel * 12 for p in streamed), default=0),
        "losses": losses, "host_losses": host_losses,
        "params": _params(e), "host_params": host_params,
        "masters_equal": all(np.array_equal(a, b) for a, b in zip(_masters(e), host_masters,
                                                                    strict=True)),
    }
    e.close()
    return out


@pytest.mark.parametrize("stage,world", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_stage12_masters_on_nvme_train_as_host_masters_and_torch_adamw(tmp_path, stage, world):
    r, *_ = run_ranks(_training_phase, world, str(tmp_path), stage, timeout=300)
    # paged: no host master, the masters are a third tensor of every swap piece
    assert r["paged"] and r["meta_masters"], r
    assert r["kinds"] == ["master", "exp_avg", "exp_avg_sq"], r["kinds"]
    assert r["spill_left"] == [], r["spill_left"]
    # each streamed piece's master and moments go through the disk each way per step (but a
    # piece the window still caches at the sweep's end): more than the moments' 8 of 12 bytes
    assert r["streamed_bytes"] > 0 and r["streamed_bytes"] == r["streamed_by_hand"]
    # engine.stats() reports the plan a benchmark checks a step's disk bytes against
    assert r["report"]["streamed_bytes_each_way"] == r["streamed_by_hand"], r["report"]
    assert r["report"]["kinds"] == r["kinds"]
    assert (r["report"]["pieces"], r["report"]["resident_pieces"]) == (r["n_pieces"],
                                                                      r["resident"])
    assert r["masters_equal"]  # and the masters, bit for bit as the host-master run's
    assert_streamed_and_exact(r)


def _checkpoint_phase(root, stage):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    e = _engine(stage, world, os.path.join(root, f"a{rank}"), "nvme")
    [_iteration(e, i) for i in range(2)]
    e.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    straight = [_iteration(e, i) for i in range(2, STEPS)]
    params, masters = _params(e), _masters(e)
    e.close()

    r = _engine(stage, world, os.path.join(root, f"b{rank}"), "nvme")
    _iteration(r, 7)  # state the load must replace, masters and 16-bit replica alike
    r.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    resumed = [_iteration(r, i) for i in range(2, STEPS)]
    loaded = _params(r)
    out = {"paged": r.partitioner.paged is not None, "straight": straight, "resumed": resumed,
           "params_equal": {k: bool(np.array_equal(v, params[k])) for k, v in loaded.items()}
           if rank == 0 else {"": True},
           "masters_equal": all(np.array_equal(a, b) for a, b in zip(masters, _masters(r),
                                                                      strict=True))}
    r.close()
    return out


@pytest.mark.parametrize("stage,world", [(1, 1), (2, 2)])
def test_a_checkpoint_of_stage12_nvme_masters_resumes_as_the_uninterrupted_run(tmp_path, stage,
                                                                               world):
    for r in run_ranks(_checkpoint_phase, world, str(tmp_path), stage, timeout=300):
        assert r["paged"]
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
        assert r["masters_equal"]
        assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]


def _placement_phase(root):
    out = {}
    for name, masters, budget in (("auto_roomy", "auto", HOST_BUDGET),
                                  ("nvme_roomy", "nvme", HOST_BUDGET)):
        e = _engine(2, 1, os.path.join(root, name), masters, budget)
        out[name] = (e.partitioner.paged is not None,
                     all(g.master.is_meta for g in e.partitioner.groups))
        e.close()
    return out


def test_auto_keeps_host_masters_with_room_and_nvme_pages_whatever_the_budget(tmp_path):
    r, = run_ranks(_placement_phase, 1, str(tmp_path), timeout=300)
    assert r == {"auto_roomy": (False, False), "nvme_roomy": (True, True)}, r


def test_masters_nvme_at_stage_0_or_with_another_rule_is_a_config_error(tmp_path):
    import zeroio
    from zeroio.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 0, "offload_optimizer": {
                "device": "nvme", "nvme_path": str(tmp_path), "masters": "nvme"}}}
    with pytest.raises(ConfigError, match="offload_optimizer.masters"):
        zeroio.load_config(base)
    base["zero_optimization"]["stage"] = 2
    assert zeroio.load_config(base).zero_optimization.offload_optimizer.masters == "nvme"
    run_ranks(_lion_phase, 1, str(tmp_path), timeout=120)


def _lion_phase(root):
    from zeroio.errors import ConfigError

    try:
        _engine(2, 1, os.path.join(root, "lion"), "nvme", rule="Lion")
    except ConfigError as exc:
        assert "offload_optimizer.masters" in str(exc) and "lion" in str(exc).lower(), exc
        return None
    raise AssertionError("Lion with masters nvme at stage 2 built")


def test_estimate_counts_stage12_paged_masters_on_the_nvme_tier():
    """By hand: 1e9 parameters on one GPU at stage 2, fp32 state: 4 GB of masters and 8 GB of
    moments, 4 GB of gradient shard; a budget below their 16 GB pages the masters."""
    import zeroio
    from zeroio.estimate import estimate_memory

    def items(budget):
        cfg = zeroio.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"},
            "tiering": {"cpu_budget_bytes": budget}}})
        return {i.name: (i.tier, i.bytes_per_gpu)
                for i in estimate_memory(10**9, 1, 1, config=cfg).items}

    paged = items(8 * 10**9)
    assert "optimizer fp32 masters" not in paged
    assert paged["optimizer masters and moments"] == ("nvme", 12 * 10**9)
    roomy = items(64 * 10**9)
    assert roomy["optimizer fp32 masters"] == ("cpu", 4 * 10**9)
    assert roomy["optimizer moments"] == ("nvme", 8 * 10**9)


def _bf16_iteration(engine, i: int) -> float:
    x, y = _batch(i)
    loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _bf16_phase(root):
    from zeroio.checkpoint.export16 import gather_weights

    out = {}
    for masters, budget in (("host", HOST_BUDGET), ("nvme", None)):
        e = _engine(2, 1, os.path.join(root, masters), masters, budget, bf16=True)
        out[masters] = {"paged": e.partitioner.paged is not None,
                        "dtype": str(e.partitioner.params.dtype),
                        "losses": [_bf16_iteration(e, i) for i in range(3)],
                        "params": {n: t.float().numpy() for n, t in gather_weights(e).items()}}
        e.close()
    return out


def test_a_bf16_replica_published_from_paged_masters_equals_host_masters(tmp_path):
    r, = run_ranks(_bf16_phase, 1, str(tmp_path), timeout=300)
    assert r["nvme"]["paged"] and not r["host"]["paged"]
    assert r["nvme"]["dtype"] == "torch.bfloat16"
    assert r["nvme"]["losses"] == r["host"]["losses"]
    for k, v in r["host"]["params"].items():
        assert np.array_equal(r["nvme"]["params"][k], v), k
