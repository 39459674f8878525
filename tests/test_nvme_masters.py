"""Masters paged through NVMe with the moments (offload_optimizer.masters; [Note: where the
masters live] in zeroio/optim/swap.py, [Note: paged masters] in zeroio/shard/paged.py).

References: plain torch AdamW on an unpartitioned copy of the model (losses and final
weights within fp32 tolerance), zeroio's own run with host masters (bit for bit), the
optimizer store's byte counters against the swap plan's arithmetic (every streamed piece's
master and both moments read and written once per step), an uninterrupted run for a
checkpoint round trip, and the state before a step whose first window's read fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from zeroio.testing import run_ranks
from zeroio.testing.disk_faults import DiskFaults

BATCH, STEPS = 4, 5
LR, WD = 1e-2, 0.01
HOST_BUDGET = 1 << 22
"""Room for everything: the host-master reference."""
NVME_BUDGET = {1: 100_000, 2: 80_000}
"""Per rank: at world 1 the 16-bit shards (~50 KB; fp32 on the CPU) plus ~50 KB for the
optimizer, whose masters, gradients and moments are ~200 KB; at world 2 ~50 KB held and ~30 KB
for ~100 KB of optimizer state: well below masters + moments. The paging tests ask for "nvme";
"auto" is tested on its own (``test_auto_pages_where_host_masters_leave_no_window``)."""
PARAMS_NVME_LESS = 30_000
"""With offload_param nvme the 16-bit shards page too and nothing is held outside the stores:
the budget is lower by about the shards' bytes, so the optimizer's share stays as small."""


def _budget(world: int, params: str) -> int:
    return NVME_BUDGET[world] - (PARAMS_NVME_LESS if params == "nvme" else 0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))


def _config(world: int, nvme: str, masters: str, budget: int, params: str = "none") -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "sub_group_size": 1024,
                              "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                                    "masters": masters},
                              "offload_param": {"device": params, "nvme_path": nvme},
                              "tiering": {"cpu_budget_bytes": budget}},
    }


def _engine(world, nvme, masters="nvme", budget=None, params="none"):
    import zeroio

    budget = NVME_BUDGET[world] if budget is None else budget
    engine, *_ = zeroio.initialize(model=_model(),
                                   config=_config(world, nvme, masters, budget, params))
    engine.show_progress = False
    return engine


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 32, generator=g)


def _iteration(engine, i: int) -> float:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    x, y = _batch(i)
    loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]),
                                        y[rank * per:(rank + 1) * per])
    engine.backward(loss)
    engine.step()
    t = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def _params(engine) -> dict[str, np.ndarray]:
    from zeroio.checkpoint.export16 import gather_weights

    return {n: t.numpy().copy() for n, t in (gather_weights(engine) or {}).items()}


def _masters(engine) -> list[np.ndarray]:
    return [engine.optimizer.local_tensor(g.group_index, "fp32").clone().numpy()
            for g in engine.partitioner.groups]


def _torch_adamw() -> tuple[list[float], dict[str, np.ndarray]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.999),
                            eps=1e-8)
    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _training_phase(root, params):
    import torch.distributed as dist

    from zeroio.tiering import stats as tstats

    rank, world = dist.get_rank(), dist.get_world_size()
    host = _engine(world, os.path.join(root, f"host{rank}"), "host", HOST_BUDGET, params)
    host_losses = [_iteration(host, i) for i in range(STEPS)]
    host_params = _params(host)
    host_held = tstats.held_bytes(host.partitioner.held_tensors()).get("cpu", 0)
    # the host-master run's master and gradient shards, which the paged run keeps in the store
    shard_bytes = sum(t.numel() * t.element_size() for g in host.partitioner.groups
                      for t in (g.master, g.grad))
    host.close()

    nvme = os.path.join(root, f"nvme{rank}")
    e = _engine(world, nvme, params=params, budget=_budget(world, params))
    spill_left = sorted(n for n in os.listdir(nvme) if n.startswith("zeroio-masters-init"))
    opt = e.optimizer
    moved = []
    losses = []
    for i in range(STEPS):
        losses.append(_iteration(e, i))
        opt.drain()
        moved.append(dict(opt.store.stats()["bytes_moved"]))
    tiers = e.stats()["tiers"]
    streamed = list(opt.pieces[opt.plan.resident:])
    params = _params(e)  # a collective: every rank
    per_step = [{k: b.get(k, 0) - a.get(k, 0) for k in ("nvme->cpu", "cpu->nvme")}
                for a, b in zip(moved, moved[1:], strict=False)]
    out = {
        "paged": e.partitioner.paged is not None, "spill_left": spill_left,
        "kinds": list(opt._kinds),
        "meta_masters": all(g.master.is_meta for g in e.partitioner.groups),
        "held": tstats.held_bytes(e.partitioner.held_tensors()).get("cpu", 0),
        # the 16-bit shards, which the host-master run reads from its masters instead
        # (tiering.params_from_master "auto")
        "shards16": tstats.held_bytes(e.partitioner.store.held_tensors()).get("cpu", 0),
        "host_held": host_held, "shard_bytes": shard_bytes,
        "store_cpu_budget": opt.store.stats()["tiers"]["cpu"]["budget_bytes"],
        "optimizer_state": sum(p.numel for p in opt.pieces) * 12,
        "streamed_bytes": opt.plan.streamed_bytes,
        # fp32 compute on the CPU: the host gradient is fp32 too (4 bytes beside the 12)
        "streamed_by_hand": sum(p.numel * (4 + 4 + 4 + 4) for p in streamed),
        "streamed_masters": len(streamed), "per_element": 16,
        "largest_piece": max(p.numel * 16 for p in streamed),
        "per_step": per_step,
        "losses": losses, "host_losses": host_losses,
        "params": params, "host_params": host_params,
        "cpu_used": tiers["cpu"]["used_bytes"], "cpu_budget": tiers["cpu"]["budget_bytes"],
    }
    e.close()
    return out


@pytest.mark.parametrize("world,params", [(1, "none"), (2, "none"), (1, "nvme"), (2, "nvme")])
def test_masters_on_nvme_train_as_torch_adamw_and_as_host_masters_bit_for_bit(tmp_path, world,
                                                                              params):
    """``params``: offload_param.device, the 16-bit shards' home (nvme: the stage-3 NVMe
    parameter store, which each master piece is published into)."""
    r, *_ = run_ranks(_training_phase, world, str(tmp_path), params, timeout=300)
    assert r["paged"] and r["kinds"] == ["master", "grad", "exp_avg", "exp_avg_sq"], r["kinds"]
    assert r["spill_left"] == [], r["spill_left"]  # the initial masters go to one folder only
    # no host master or gradient shard: the partitioner holds the host-master run's bytes minus
    # those shards, plus the 16-bit shards the gathers read now (in host memory or its NVMe
    # store)
    assert r["meta_masters"] and (r["shards16"] > 0) == (params == "none")
    assert r["held"] - r["shards16"] == r["host_held"] - r["shard_bytes"], r
    # the optimizer's host memory is its budget share, below its masters + moments, and all
    # the host state engine.stats() counts stays within the user's budget
    assert r["store_cpu_budget"] < r["optimizer_state"] / 2, r
    assert r["cpu_budget"] == _budget(world, params) and r["cpu_used"] <= r["cpu_budget"], r
    # every streamed piece's master, gradient and moments go through the disk once each way
    # per step (but a piece the window's spare room still caches at the sweep's end), so far
    # more than the moments alone (8 of the 16 bytes)
    assert r["streamed_masters"] > 0 and r["streamed_bytes"] == r["streamed_by_hand"]
    assert_streamed_and_exact(r)


def assert_streamed_and_exact(r: dict) -> None:
    """A paged run ``r`` against the plan's disk bytes, zeroio's host masters and torch AdamW:
    each step moves, each way, at least what the moments alone would (8 of ``per_element``
    bytes: 12, 16 with the gradient) and all the streamed bytes but one piece's at most;
    losses and weights bit for bit as the host-master run's, and as plain torch AdamW within
    fp32 tolerance."""
    per = r.get("per_element", 12)
    low = max(r["streamed_bytes"] - r["largest_piece"], r["streamed_bytes"] * 8 // per + 1)
    for moved in r["per_step"]:
        for way in ("nvme->cpu", "cpu->nvme"):
            assert low <= moved[way] <= r["streamed_bytes"], (moved, r["streamed_bytes"], low)
    assert r["losses"] == r["host_losses"]
    assert r["params"].keys() == r["host_params"].keys()
    for k, v in r["params"].items():
        assert np.array_equal(v, r["host_params"][k]), k
    ref_losses, ref_params = _torch_adamw()
    np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5, atol=1e-6)
    for k, v in ref_params.items():
        np.testing.assert_allclose(r["params"][k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def _checkpoint_phase(root):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    e = _engine(world, os.path.join(root, f"a{rank}"))
    first = [_iteration(e, i) for i in range(2)]
    e.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    shared = e.last_save.get("bytes_shared", 0)  # the masters' swap files linked too
    real = sum(g.numel for g in e.partitioner.groups)
    straight = [_iteration(e, i) for i in range(2, STEPS)]
    params, masters = _params(e), _masters(e)
    e.close()

    r = _engine(world, os.path.join(root, f"b{rank}"))
    _iteration(r, 7)  # state the load must replace, masters and 16-bit shards alike
    r.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    resumed = [_iteration(r, i) for i in range(2, STEPS)]
    loaded = _params(r)  # a collective: every rank
    out = {"paged": r.partitioner.paged is not None, "first": first, "straight": straight,
           "shared": shared, "real": real,
           "resumed": resumed,
           "params_equal": {k: bool(np.array_equal(v, params[k]))
                            for k, v in loaded.items()} if rank == 0 else {"": True},
           "masters_equal": all(np.array_equal(a, b) for a, b in zip(masters, _masters(r),
                                                                      strict=True))}
    r.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_checkpoint_of_nvme_masters_resumes_as_the_uninterrupted_run(tmp_path, world):
    results = run_ranks(_checkpoint_phase, world, str(tmp_path), timeout=300)
    for r in results:
        assert r["paged"]
        assert r["shared"] >= 12 * r["real"], r  # masters and moments linked, not copied
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
        assert r["masters_equal"]
        assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]


def _stage_engine(stage: int, world: int, nvme: str):
    """Paged masters at ``stage``: this file's stage-3 engine, test_nvme_masters12's at 1/2."""
    if stage == 3:
        return _engine(world, nvme)
    from test_nvme_masters12 import _engine as engine12

    return engine12(stage, world, nvme, "nvme")


def _first_window_phase(root, stage):
    import torch.distributed as dist

    from zeroio.errors import SwapIOError

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _stage_engine(stage, world, os.path.join(root, f"ref{rank}"))
    straight = [_iteration(ref, i) for i in range(4)]
    straight_params = _params(ref)
    ref.close()

    e = _stage_engine(stage, world, os.path.join(root, f"e{rank}"))
    first = [_iteration(e, i) for i in range(2)]
    masters = _masters(e)
    opt = e.optimizer
    # the first streamed piece past the read-ahead is read in the step's first window, before
    # any piece is updated: its master fails
    faults = DiskFaults(e)
    faults.fail_reads({opt.pieces[opt.plan.resident + opt.plan.read_ahead].name("master")})
    steps_before, err = e.global_steps, None
    try:
        _iteration(e, 2)
    except SwapIOError as exc:
        err = f"{type(exc).__name__}: {exc}"
    faults.clear()  # the disk is well again: the masters read as before the step
    same = all(np.array_equal(a, b) for a, b in zip(masters, _masters(e), strict=True))
    steps_after = e.global_steps
    rest = [_iteration(e, i) for i in range(2, 4)]
    params = _params(e)
    e.close()
    return {"err": err, "same_masters": same, "steps": (steps_before, steps_after),
            "first": first, "rest": rest, "straight": straight,
            "params_equal": {k: bool(np.array_equal(v, params[k]))
                             for k, v in straight_params.items()} if rank == 0 else None}


@pytest.mark.parametrize("stage,world", [(3, 1), (3, 2), (1, 1), (2, 2)])
def test_a_master_read_failing_in_the_first_window_rolls_back_and_the_retry_is_exact(tmp_path,
                                                                                    stage, world):
    """[Note: reads before writes] in optim/swap.py with paged masters (stage 3, and stages 1/2
    with a one-rank and a two-rank world): nothing was changed (masters, counters), and the
    retried run equals the uninterrupted one on every rank."""
    results = run_ranks(_first_window_phase, world, str(tmp_path), stage, timeout=300)
    for r in results:
        assert r["err"] is not None and "injected read error" in r["err"], r["err"]
        assert r["same_masters"] and r["steps"][0] == r["steps"][1], r
        assert r["first"] + r["rest"] == r["straight"]
    equal = results[0]["params_equal"]
    assert equal and all(equal.values()), equal


def test_masters_nvme_where_it_cannot_apply_is_a_config_error():
    import zeroio
    from zeroio.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 0, "offload_optimizer": {
                "device": "nvme", "nvme_path": "/tmp/x", "masters": "nvme"}}}
    with pytest.raises(ConfigError, match="offload_optimizer.masters"):
        zeroio.load_config(base)
    base["zero_optimization"]["stage"] = 3
    base["zero_optimization"]["tiering"] = {"params_from_master": True}
    with pytest.raises(ConfigError, match="params_from_master"):
        zeroio.load_config(base)
    base["zero_optimization"]["offload_optimizer"]["masters"] = "disk"
    with pytest.raises(ConfigError, match="offload_optimizer.masters"):
        zeroio.load_config(base)


def test_estimate_counts_paged_masters_on_the_nvme_tier():
    """By hand: 1e9 parameters on one GPU, fp32 state: 4 GB of masters and 8 GB of moments;
    the gradient shard 4 GB more (fp32: no bf16), which pages with them ([Note: paged
    gradients] in zeroio/shard/paged_grads.py) where the masters page."""
    import zeroio
    from zeroio.estimate import estimate_memory

    def tiers(budget, masters="auto"):
        cfg = zeroio.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x",
                                              "masters": masters},
            "tiering": {"cpu_budget_bytes": budget}}})
        est = estimate_memory(10**9, 1, 1, config=cfg)
        return {i.name: (i.tier, i.bytes_per_gpu) for i in est.items}, est.params_from_master

    # a budget below masters + moments + gradient shard (16 GB): the masters page, and the
    # gradient with them
    items, pfm = tiers(8 * 10**9)
    assert "optimizer fp32 masters" not in items and not pfm
    assert items["gradients"] == ("nvme", 4 * 10**9), items
    # the disk homes all 12 bytes per parameter; the host keeps the swap window (the piece being
    # updated, 2^24 elements of master, gradient and moments: 16 bytes each; pipeline_read is
    # off, nothing is read ahead) and caches whole pieces of what the budget leaves past it
    assert items["optimizer masters and moments"] == ("nvme", 12 * 10**9), items
    piece = 16 * (1 << 24)
    assert items["optimizer swap window (pinned)"] == ("cpu", piece)
    tier, cached = items["optimizer masters and moments cached in host memory "
                         "(tiering.cpu_budget_bytes)"]
    assert tier == "cpu" and cached > 0 and cached % piece == 0
    host = sum(b for t, b in items.values() if t == "cpu")
    assert 8 * 10**9 - piece < host <= 8 * 10**9  # the budget, but for less than a piece
    # room for all of them: the masters stay in host memory, the gathers read them
    items, pfm = tiers(64 * 10**9)
    assert items["optimizer fp32 masters"] == ("cpu", 4 * 10**9) and pfm
    assert items["optimizer moments"] == ("nvme", 8 * 10**9)
    assert items["gradients"] == ("cpu", 4 * 10**9)
    # "host" keeps them there whatever the budget
    items, _ = tiers(8 * 10**9, "host")
    assert items["optimizer fp32 masters"] == ("cpu", 4 * 10**9)


def _modifier_phase(root):
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for masters, budget in (("host", HOST_BUDGET), ("nvme", None)):
        e = _engine(world, os.path.join(root, f"{masters}{rank}"), masters, budget)
        losses = [_iteration(e, i) for i in range(2)]
        weight = e.module[0].weight
        with zeroio.zero.GatheredParameters([weight], modifier_rank=0):
            if rank == 0:
                weight.data.mul_(0.5)  # reaches the masters (paged: through the store)
        losses += [_iteration(e, i) for i in range(2, 4)]
        out[masters] = {"paged": e.partitioner.paged is not None, "losses": losses,
                        "masters": _masters(e)}
        e.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_gathered_parameters_modifier_writes_the_paged_masters(tmp_path, world):
    r, *_ = run_ranks(_modifier_phase, world, str(tmp_path), timeout=300)
    assert r["nvme"]["paged"] and not r["host"]["paged"]
    assert r["nvme"]["losses"] == r["host"]["losses"]
    for a, b in zip(r["nvme"]["masters"], r["host"]["masters"], strict=True):
        assert np.array_equal(a, b)


def _auto_phase(root):
    out = {}
    for name, budget in (("roomy", HOST_BUDGET), ("tight", AUTO_TIGHT)):
        e = _engine(1, os.path.join(root, name), "auto", budget)
        numel = sum(g.master.numel() for g in e.partitioner.groups)
        out[name] = {"paged": e.partitioner.paged is not None, "numel": numel,
                     "loss": _iteration(e, 0)}
        e.close()
    return out


AUTO_TIGHT = 120_000
"""Below 4/3 x (4-byte masters + 4-byte gradient) of the ~12.5k elements (~133 KB), and still
room for the 16-bit shards, the gradient and a window: "auto" pages."""


def test_auto_pages_where_host_masters_leave_no_window(tmp_path):
    """``masters: "auto"`` (config/zero.py ``masters_paged``, ``MASTERS_ROOM``): host masters
    where they and the gradient take at most 3/4 of the budget, paged below; by hand."""
    from zeroio.config.zero import MASTERS_ROOM, masters_paged

    r, = run_ranks(_auto_phase, 1, str(tmp_path), timeout=300)
    need = r["tight"]["numel"] * 2 * 4 * MASTERS_ROOM
    assert AUTO_TIGHT < need <= HOST_BUDGET
    assert r["tight"]["paged"] and not r["roomy"]["paged"]
    assert r["tight"]["loss"] == r["roomy"]["loss"]  # the first step's loss: same weights
    # the rule by hand: 3000 elements of 4 bytes -> 3000 * 8 * 4 / 3 = 32000 bytes
    kw = {"host_numel": 3000, "master_bytes": 4, "state_bytes": 4}
    assert masters_paged("auto", cpu_budget_bytes=31_999, **kw)
    assert not masters_paged("auto", cpu_budget_bytes=32_000, **kw)
    assert not masters_paged("auto", cpu_budget_bytes=None, **kw)
    assert masters_paged("nvme", cpu_budget_bytes=None, **kw)
    assert not masters_paged("host", cpu_budget_bytes=1, **kw)
