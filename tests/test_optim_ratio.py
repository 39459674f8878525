"""zero_optimization.offload_optimizer.ratio: part of the stage-3 optimizer state on the device.

Tiny Hugging Face Llama (tied embeddings, gradient checkpointing) on 1 and 2
gloo ranks, 10 steps of 2 micro steps with clipping, against single-process
torch.optim.AdamW (zeroio.testing.reference). On this CPU-only machine the
"device" side lives on the engine's device (cpu) but takes the same path as on
a GPU: its own ShardGroups, gradients landed there, stepped by the device-side
``ShardedAdam``, published by ``run_step`` before the host jobs.

Tolerances as in test_stage3_equivalence (fp32): 2e-5 relative on the loss,
2e-5 absolute on the fp32 masters, and what ``GatheredParameters`` sees equals
the masters exactly. Element counts are checked against a hand count:
``floor((1 - ratio) * local elements)`` on the device side.
"""

from __future__ import annotations

import math
import os

import pytest

from zeroio.testing import run_ranks
from zeroio.testing.models import (
    SMALL_STAGE3,
    llama_reference,
    offload_optimizer,
    offload_param,
    stage3_config,
    tiny_llama,
    token_batches,
)
from zeroio.testing.training import (
    gather_state,
    gathered_params,
    reference_diffs,
    reference_failures,
    train_steps,
)

STEPS, GAS, MICRO, LR, CLIP = 10, 2, 2, 1e-3, 0.05


def _batches(world, steps=STEPS, seed=1234):
    return token_batches(world, steps=steps, gas=GAS, micro=MICRO, seed=seed)


def _config(*, off_param="none", off_opt="cpu", ratio=None, overlap=False, nvme_dir=None):
    return stage3_config(micro=MICRO, gas=GAS, clip=CLIP, lr=LR, zero=dict(
        SMALL_STAGE3, stage3_param_persistence_threshold=0,
        offload_param=offload_param(off_param, nvme_dir),
        offload_optimizer=offload_optimizer(off_opt, nvme_dir, ratio),
        tiering={"overlap_step": overlap}))


def _param_groups(model):
    """Two optimizer groups as Hugging Face's Trainer makes them: decay for matrices only."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _engine(init, cfg, groups=False):
    import torch

    import zeroio

    model = tiny_llama()
    model.load_state_dict(init)
    client = None
    if groups:  # a client AdamW with two param groups instead of the config's optimizer
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        client = torch.optim.AdamW(_param_groups(model), lr=LR)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg, optimizer=client)
    return engine


def _sides(engine):
    """(device elements, host elements, local elements) of this rank."""
    split = engine.partitioner.optimizer_split
    total = sum(g.numel for g in engine.partitioner.groups)
    if split is None:
        return 0, total, total
    return sum(g.numel for g in split.device), sum(g.numel for g in split.host), total


# ---- equivalence with plain AdamW ------------------------------------------------------------

CASES = {
    1: [dict(ratio=0.5), dict(ratio=0.3, off_param="cpu"), dict(ratio=0.5, off_opt="nvme"),
        dict(ratio=0.4, off_param="nvme"), dict(ratio=1.0, off_param="cpu")],
    2: [dict(ratio=0.5), dict(ratio=0.3, off_param="cpu"),
        dict(ratio=0.5, off_param="cpu", overlap=True), dict(ratio=0.6, groups=True)],
}


def _equivalence_body(tmpdir):
    import torch
    import torch.distributed as dist

    from zeroio.optim.adam import ShardedAdam
    from zeroio.optim.twin import TwinAdam

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    n_params = sum(v.numel() for k, v in tiny_llama().named_parameters())
    batches = _batches(world)
    plain_ref = llama_reference(batches, init, lr=LR, clip=CLIP)
    grouped_ref = (llama_reference(batches, init, lr=LR, clip=CLIP, param_groups=_param_groups)
                   if any(c.get("groups") for c in CASES[world]) else None)
    out = []
    for i, case in enumerate(CASES[world]):
        case = dict(case)
        groups = case.pop("groups", False)
        ref_losses, ref_params = grouped_ref if groups else plain_ref
        engine = _engine(init, _config(**case, nvme_dir=os.path.join(tmpdir, f"{i}-r{rank}")),
                         groups=groups)
        n_groups = len(engine.partitioner.groups)
        twin = isinstance(engine.optimizer, TwinAdam)
        dev, host, total = _sides(engine)
        devices = set()
        if twin:  # where each side's state lives
            split = engine.partitioner.optimizer_split
            devices = {(g.master.device.type, g.grad.device.type) for g in split.device}
        losses = train_steps(engine, batches)
        masters = gather_state(engine)
        published = gathered_params(engine)
        totals = torch.tensor([total], dtype=torch.int64)
        dist.all_reduce(totals)
        engine.close()
        out.append(dict(
            case={**case, "groups": groups}, groups=n_groups, twin=twin, plain=isinstance(engine.optimizer, ShardedAdam),
            dev=dev, host=host, total=total, global_total=int(totals.item()),
            n_params=n_params, devices=devices,
            **reference_diffs(losses, published, masters, ref_losses, ref_params, init, "fp32")))
    return out


def _check_equivalence(results):
    for rank_results in results:
        for r in rank_results:
            ratio = r["case"]["ratio"]
            assert r["global_total"] == r["n_params"], r  # every element on one rank, once
            assert r["dev"] + r["host"] == r["total"], r
            assert r["groups"] == (2 if r["case"].get("groups") else 1), r
            # hand count: floor((1 - ratio) * local elements) on the device side
            assert r["dev"] == (0 if ratio == 1.0 else math.floor(r["total"] * (1 - ratio))), r
            if ratio < 1.0:
                assert r["twin"] and r["dev"] > 0 and r["host"] > 0, r
                assert r["devices"] == {("cpu", "cpu")}, r  # the engine device of this machine
            else:  # ratio 1.0: the optimizer and shards are what they were before the ratio
                assert r["plain"] and not r["twin"], r
            assert not reference_failures(r, "fp32", fp32_tol=2e-5), r
def test_ratio_matches_adamw_world_1(tmp_path):
    _check_equivalence(run_ranks(_equivalence_body, 1, str(tmp_path), timeout=240))


def test_ratio_matches_adamw_world_2(tmp_path):
    _check_equivalence(run_ranks(_equivalence_body, 2, str(tmp_path), timeout=240))


# ---- checkpoints across ratios ---------------------------------------------------------------

def _checkpoint_body(tmpdir, save_ratio, load_ratio):
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    first, rest = _batches(world, 4, seed=7), _batches(world, 4, seed=8)
    engine = _engine(init, _config(ratio=save_ratio))
    train_steps(engine, first)
    engine.save_checkpoint(os.path.join(tmpdir, "ckpt"), tag="t")
    saved = {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    steps = [engine.optimizer.steps_taken(i) for i in range(len(engine.partitioner.groups))]
    cont_losses = train_steps(engine, rest)
    cont = gather_state(engine)
    engine.close()

    other = _engine({k: torch.zeros_like(v) for k, v in init.items()}, _config(ratio=load_ratio))
    other.load_checkpoint(os.path.join(tmpdir, "ckpt"), tag="t")
    loaded = {k: gather_state(other, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    loaded_steps = [other.optimizer.steps_taken(i) for i in range(len(other.partitioner.groups))]
    loaded_published = gathered_params(other)
    resumed_losses = train_steps(other, rest)
    resumed = gather_state(other)
    other.close()
    return dict(
        state_diff=max((saved[k][n] - loaded[k][n]).abs().max().item()
                       for k in saved for n in saved[k]),
        steps=(steps, loaded_steps),
        published_diff=max((loaded_published[n] - loaded["fp32"][n]).abs().max().item()
                           for n in loaded["fp32"]),
        loss_diff=max(abs(a - b) for a, b in zip(cont_losses, resumed_losses, strict=True)),
        param_diff=max((cont[n] - resumed[n]).abs().max().item() for n in cont))


@pytest.mark.parametrize("world,save_ratio,load_ratio", [(1, 0.5, 1.0), (2, 1.0, 0.5),
                                                         (2, 0.5, 0.3)])
def test_checkpoint_across_ratios(tmp_path, world, save_ratio, load_ratio):
    for r in run_ranks(_checkpoint_body, world, str(tmp_path), save_ratio, load_ratio,
                       timeout=200):
        assert r["state_diff"] == 0.0, r  # masters and both moments, bit for bit
        assert r["steps"][0] == r["steps"][1], r
        assert r["published_diff"] == 0.0, r  # the 16-bit params republished from them
        # the same math from the same state; only the norm's summation order may differ
        assert r["loss_diff"] < 1e-6, r
        assert r["param_diff"] < 1e-6, r


# ---- placement and config --------------------------------------------------------------------

def test_place_cuts_the_straddling_piece_and_keeps_every_element():
    from zeroio.partition.base import Segment
    from zeroio.partition.stage3.layout import ShardPiece
    from zeroio.partition.stage3.twin import Side, device_numel, place

    a = ShardPiece(opt_group=0, lo=0, hi=10, names=("w", "b"),
                   segments=(Segment(local_offset=0, global_offset=100, numel=6),
                             Segment(local_offset=6, global_offset=300, numel=4)))
    b = ShardPiece(opt_group=1, lo=10, hi=15, names=("n",),
                   segments=(Segment(local_offset=0, global_offset=500, numel=5),))
    assert device_numel(15, 0.6) == 6 and device_numel(15, 1.0) == 0
    out = place([(0, a), (1, b)], 8)
    assert [(gi, p.lo, p.hi, s) for gi, p, s in out] == [
        (0, 0, 8, Side.DEVICE), (0, 8, 10, Side.HOST), (1, 10, 15, Side.HOST)]
    head, tail = out[0][1], out[1][1]
    assert head.segments == (Segment(local_offset=0, global_offset=100, numel=6),
                             Segment(local_offset=6, global_offset=300, numel=2))
    assert tail.segments == (Segment(local_offset=0, global_offset=302, numel=2),)
    assert head.names == ("w", "b") and tail.names == ("b",)
    covered = sorted((s.global_offset, s.numel) for _, p, _ in out for s in p.segments)
    assert covered == [(100, 6), (300, 2), (302, 2), (500, 5)]


@pytest.mark.parametrize("value", [0, 1.5, "x", -0.2, True, float("nan")])
def test_invalid_ratio_is_a_config_error_naming_the_key(value):
    import zeroio

    cfg = _config(ratio=value)
    with pytest.raises(zeroio.ConfigError) as e:
        zeroio.load_config(cfg)
    assert e.value.key == "zero_optimization.offload_optimizer.ratio"
    assert "zero_optimization.offload_optimizer.ratio" in str(e.value)


def test_ratio_below_one_needs_stage_1_or_more():
    import zeroio

    cfg = _config(ratio=0.5)
    cfg["zero_optimization"]["stage"] = 0
    with pytest.raises(zeroio.ConfigError, match="needs zero_optimization.stage 1, 2 or 3") as e:
        zeroio.load_config(cfg)
    assert e.value.key == "zero_optimization.offload_optimizer.ratio"
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0
    assert zeroio.load_config(cfg).zero_optimization.offload_optimizer.ratio == 1.0


# ---- memory estimate -------------------------------------------------------------------------

def test_estimate_with_ratio_by_hand(monkeypatch):
    import zeroio

    # fp32 host gradients: torch's CPU Adam (the one-pass kernel's 16-bit host gradients are
    # counted by tests/test_stage3_16bit_grads.py)
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")

    # 4000 parameters on one GPU, bf16, ratio 0.25: floor(0.75 * 4000) = 3000 elements keep
    # their optimizer state (12 B) and fp32 gradient (4 B) on the GPU; stage 3 keeps no bf16
    # gradient shard (the reduced bucket lands in the fp32 one)
    est = zeroio.estimate_memory(4000, stage=3, offload_optimizer="cpu", offload_param="none",
                                 dtype="bf16", ratio=0.25)
    live = 2 * 4000  # stage3_max_live_parameters + group, capped at Psi, bf16
    buckets = 2 * 4 * 4000 + 2 * 4000  # two fp32 group buckets + bf16 autograd gradients
    assert est.gpu_bytes_per_gpu == 2 * 4000 + 16 * 3000 + live + buckets
    assert est.cpu_bytes_per_node == 16 * 1000
    assert est.nvme_bytes_per_node == 0
    assert est.to_dict()["optimizer_placement"] == {"gpu_elements_per_gpu": 3000,
                                                    "offloaded_elements_per_gpu": 1000}
    # nvme: the offloaded moments go to the disk, masters and gradients stay in CPU memory,
    # swap buffers are sized by the offloaded elements (4 x min(sub_group_size, 1000) x 4 B)
    est = zeroio.estimate_memory(4000, stage=3, offload_optimizer="nvme", dtype="bf16",
                                 ratio=0.25)
    assert est.nvme_bytes_per_node == 8 * 1000  # moments; the fp32 masters stay on the host
    assert est.cpu_bytes_per_node == (4 + 4) * 1000 + 4 * 1000 * 4
    # two GPUs: the shard is 2000, 1500 of it on the GPU; ratio 1 is the plain estimate
    est = zeroio.estimate_memory(4000, gpus_per_node=2, stage=3, offload_optimizer="cpu",
                                 dtype="bf16", ratio=0.25)
    assert est.cpu_bytes_per_node == 2 * 16 * 500
    plain = zeroio.estimate_memory(4000, stage=3, offload_optimizer="cpu", dtype="bf16")
    same = zeroio.estimate_memory(4000, stage=3, offload_optimizer="cpu", dtype="bf16", ratio=1)
    assert plain.to_dict() == same.to_dict() and plain.cpu_bytes_per_node == 16 * 4000


def test_estimate_ratio_from_config_and_errors():
    import zeroio

    cfg = zeroio.load_config(_config(ratio=0.5))
    est = zeroio.estimate_memory(4000, config=cfg)
    assert est.ratio == 0.5 and est.device_elements == 2000
    with pytest.raises(zeroio.ConfigError, match="stage 1, 2 or 3"):
        zeroio.estimate_memory(4000, stage=0, ratio=0.5)
    with pytest.raises(zeroio.ConfigError, match="stage 3"):
        zeroio.estimate_memory(4000, stage=2, offload_optimizer="nvme", ratio=0.5)
    for bad in (0, 1.5, "x"):
        with pytest.raises(zeroio.ConfigError) as e:
            zeroio.estimate_memory(4000, stage=3, offload_optimizer="cpu", ratio=bad)
        assert e.value.key == "offload_optimizer.ratio"


def _save_no_full_copy_body(tmpdir):
    import torch

    from zeroio.optim.twin import TwinAdam

    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    engine = _engine(init, _config(ratio=0.5))
    train_steps(engine, _batches(1, 2, seed=7))
    opt = engine.optimizer
    split = [g.group_index for g in engine.partitioner.groups
             if opt._split(g.group_index) and opt._host_numel(g.group_index)]
    sizes, whole = [], []
    real_local, real_read = TwinAdam.local_tensor, TwinAdam.read_local

    def local_tensor(self, gi, kind):
        whole.append((gi, kind))
        return real_local(self, gi, kind)

    def read_local(self, gi, kind, lo, n):
        out = real_read(self, gi, kind, lo, n)
        sizes.append(out.numel())
        return out

    TwinAdam.local_tensor, TwinAdam.read_local = local_tensor, read_local
    try:
        engine.save_checkpoint(os.path.join(tmpdir, "ckpt"), tag="t")
    finally:
        TwinAdam.local_tensor, TwinAdam.read_local = real_local, real_read
    saved = {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    engine.close()
    other = _engine({k: torch.zeros_like(v) for k, v in init.items()}, _config(ratio=0.5))
    other.load_checkpoint(os.path.join(tmpdir, "ckpt"), tag="t")
    loaded = {k: gather_state(other, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    other.close()
    largest_param = max(v.numel() for v in init.values())
    return dict(split=split, whole=whole, max_read=max(sizes), largest_param=largest_param,
                group_numel=[opt._split(i) + opt._host_numel(i) for i in split],
                diff=max((saved[k][n] - loaded[k][n]).abs().max().item()
                         for k in saved for n in saved[k]))


def test_save_reads_split_fp32_by_range_and_round_trips(tmp_path):
    """Save at ratio 0.5: the fp32 masters of a group split over device and host are read
    through ``read_local`` segment by segment (never ``local_tensor``, whose host copy is the
    whole group: 52 GB at 13B), and a load at ratio 0.5 restores every state bit for bit."""
    (r,) = run_ranks(_save_no_full_copy_body, 1, str(tmp_path), timeout=200)
    assert r["split"], r  # the test needs a group on both sides
    assert not [w for w in r["whole"] if w[0] in r["split"]], r
    assert r["max_read"] <= r["largest_param"] < min(r["group_numel"]), r
    assert r["diff"] == 0.0, r


def test_publish_chunk_matches_the_estimate():
    from zeroio import estimate
    from zeroio.partition.stage3 import twin

    assert estimate.PUBLISH_CHUNK_NUMEL == twin.PUBLISH_CHUNK_NUMEL


# ---- all three tiers at once: the GPU share, a host-homed head, the disk tail ----------------

def _three_tier_body(tmpdir):
    """ratio 0.5 with the host side's moments on NVMe, a host budget smaller than those
    moments and an NVMe budget that holds only the streamed tail: the plan the planner
    writes for a model whose state fills every tier ([Note: resident head, streamed tail]
    in optim/swap.py). Trained against single-process AdamW."""
    import torch

    from zeroio.optim.twin import TwinAdam

    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    batches = _batches(1)
    ref_losses, ref_params = llama_reference(batches, init, lr=LR, clip=CLIP)
    nvme = os.path.join(tmpdir, "nvme")
    cfg = stage3_config(micro=MICRO, gas=GAS, clip=CLIP, lr=LR, zero=dict(
        SMALL_STAGE3, stage3_param_persistence_threshold=0, sub_group_size=2048,
        offload_param=offload_param("cpu", nvme),
        offload_optimizer=offload_optimizer("nvme", nvme, 0.5),
        tiering={"cpu_budget_bytes": 240_000, "nvme_budget_bytes": 60_000}))
    engine = _engine(init, cfg)
    assert isinstance(engine.optimizer, TwinAdam)
    swapped = engine.optimizer.host
    plan, head = swapped.plan, swapped._host_homed_head()
    per_step = []
    losses = []
    for step in batches:
        losses += train_steps(engine, [step])
        moved = engine.stats()["sources"]["optimizer"]["last_step"]["bytes_moved"]
        per_step.append((moved.get("nvme->cpu", 0), moved.get("cpu->nvme", 0)))
    tiers = engine.stats()["sources"]["optimizer"]["tiers"]
    disk, host = tiers["nvme"]["home_bytes"], tiers["cpu"]
    masters = gather_state(engine)
    published = gathered_params(engine)
    engine.close()
    return dict(pieces=len(plan.pieces), resident=plan.resident, head=head, fits=plan.fits,
                streamed=plan.streamed_bytes, disk=disk, per_step=per_step,
                host_spare=host["budget_bytes"] - host["home_bytes"],
                **reference_diffs(losses, published, masters, ref_losses, ref_params, init, "fp32"))


def test_gpu_share_host_head_and_disk_tail_train_as_adamw(tmp_path):
    (r,) = run_ranks(_three_tier_body, 1, str(tmp_path), timeout=240)
    # the head lives only in host memory, the tail streams: all three tiers hold state
    assert not r["fits"] and 0 < r["resident"] == r["head"] < r["pieces"], r
    assert r["streamed"] > 0 and r["disk"] == r["streamed"], r  # no file for the head
    # after the first step, each step reads and writes the streamed tail at most once; what it
    # saves is only what the host room beside the head kept from the step before (a small last
    # piece fits there beside the window): never more than that room
    for read, write in r["per_step"][1:]:
        assert read == write <= r["streamed"], r
        assert r["streamed"] - read <= r["host_spare"], r
    assert not reference_failures(r, "fp32", fp32_tol=2e-5), r
