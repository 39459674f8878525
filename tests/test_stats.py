"""engine.stats(): every source merged, bytes checked against hand computation.

A tiny model (4 x Linear(32, 32), bf16) is trained a few optimizer steps at
stage 2 + cpu offload, stage 3 + cpu, and stage 3 + nvme (world 1, one
spawned rank). The reference numbers come from the model's parameter count
and dtype, not from the code under test:

- stage 3 nvme: every step reads every parameter shard from NVMe at least once
  (forward), and writes every updated shard back (dirty after the optimizer's
  publish; the single-shard buffer forces it out before the next use). With
  the acquire for overwrite the publish reads nothing: at most forward +
  backward + prefetch reads remain, strictly fewer than before (measured with
  overwrite switched off on the same run).
- on this CPU-only machine no copy crosses between host and device, so no
  "cpu->gpu"/"gpu->cpu" bytes may appear (the GPU test below checks those
  against the gradient and parameter sizes).
- since-start totals equal the sum of the per-step ("last_step") values.
- ``tiers``: bytes held outside any store (masters, gradient shards, moments,
  flat buffers, host shards) against a per-parameter count; budget None where
  no store has the tier, the store's budget where one does.
"""

from __future__ import annotations

import os

import pytest

from zeroio.testing import run_ranks

STEPS = 4
LAYERS, WIDTH = 4, 32
NUMEL = LAYERS * (WIDTH * WIDTH + WIDTH)  # parameters of the model


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _config(stage, off_param, off_opt, nvme_dir, shard_numel=None):
    param = {"device": off_param}
    if off_param == "nvme":  # one buffer of one layer's shard: every shard cycles through NVMe
        param.update(nvme_path=os.path.join(nvme_dir, "param"), buffer_count=1,
                     buffer_size=shard_numel, max_in_cpu=0)  # nothing resident beyond it
    opt = {"device": off_opt}
    if off_opt == "nvme":
        opt["nvme_path"] = os.path.join(nvme_dir, "optim")
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0,
                                  "offload_param": param, "offload_optimizer": opt},
            "bf16": {"enabled": True}}


def _train(cfg, *, overwrite=True):
    import torch

    import zeroio

    engine, *_ = zeroio.initialize(model=_model(), config=cfg)
    if not overwrite:  # the old publish path: read each shard back before replacing it
        engine.partitioner._whole = dict.fromkeys(engine.partitioner._whole, False)
    device = engine.device
    steps, assisted, breakdowns = [], [], []
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(2, WIDTH, generator=g).to(device, torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        now = engine.stats()
        steps.append(now["last_step"])
        breakdowns.append({k: v for k, v in now["breakdown"]["last"].items() if k != "waits"})
        assist = [v for k, v in now["sources"].items() if k.endswith(".step_assist")]
        assisted.append(sum(a["numel_gpu"] for a in assist))  # since start
    out = engine.stats()
    groups = getattr(engine.partitioner, "pgroups", [])
    shard_numels = [g.plan.shard_numel for g in groups]
    engine.close()
    store = out.pop("sources").get("stage3.params")
    return {"total": out, "steps": steps, "shard_numels": shard_numels,
            "store_tiers": store["tiers"] if store else None, "breakdowns": breakdowns,
            "assisted": [b - a for a, b in zip([0] + assisted[:-1], assisted, strict=True)]}


def _body(tmpdir):
    res = {}
    res["z2_cpu"] = _train(_config(2, "none", "cpu", tmpdir))
    res["z3_cpu"] = _train(_config(3, "cpu", "cpu", tmpdir))
    shard = 2048  # 16-bit elements = one 4 KiB page: one layer's shard (1056 elements) fits
    for name, ow in (("z3_nvme", True), ("z3_nvme_no_overwrite", False)):
        d = os.path.join(tmpdir, name)
        res[name] = _train(_config(3, "nvme", "cpu", d, shard), overwrite=ow)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # torch's CPU Adam: the hand counts assume fp32 host gradients (the one-pass kernel keeps
    # 16-bit ones at stage 2, tests/test_cpu_adam_training.py)
    return run_ranks(_body, 1, str(tmp_path_factory.mktemp("stats")),
                     env={"ZEROIO_CPU_ADAM": "torch"})[0]


def _assert_totals_are_step_sums(r):
    total, steps = r["total"], r["steps"]
    keys = set(total["bytes_moved"]) | {k for s in steps for k in s["bytes_moved"]}
    for k in keys:
        assert total["bytes_moved"].get(k, 0) == sum(s["bytes_moved"].get(k, 0) for s in steps), k
    for k in ("stall_seconds", "busy_seconds"):
        assert total[k] == pytest.approx(sum(s[k] for s in steps), abs=1e-9)
    for k in ("hits", "misses", "writebacks", "overwrites"):
        assert total[k] == sum(s[k] for s in steps), k


def test_no_host_device_bytes_without_a_device(results):
    for name in ("z2_cpu", "z3_cpu"):
        r = results[name]
        assert r["total"]["bytes_moved"] == {}, (name, r["total"]["bytes_moved"])
        assert set(r["total"]) >= {"bytes_moved", "stall_seconds", "tiers", "last_step",
                                   "hidden_fraction", "breakdown"}
        _assert_totals_are_step_sums(r)
    for r in results.values():  # every element is stepped by CPU Adam, chunk by chunk
        for b in r["breakdowns"]:
            assert b["h2d_bytes"] == b["d2h_bytes"] == 0 and b["gpu_busy_s"] is None
            assert b["numel_cpu"] == sum(c["numel"] for c in b["chunks"]) == NUMEL


# bytes held outside any tiered store, by hand (world 1, one optimizer param group, bf16):
# fp32 master + fp32 gradient shard + exp_avg + exp_avg_sq = 16 B/param, plus the one fp32
# Adam step counter (4 B); no padding at world 1
HOST_STATE = 16 * NUMEL + 4


def test_tiers_report_memory_outside_stores(results):
    # stage 2 + cpu offload: no store at all; the flat bf16 parameter and gradient buffers
    # (2 + 2 B/param) live on the compute device, which is the CPU here; no staging buffer
    # (bf16 staging and accumulation landing are for a CUDA device / accumulation > 1)
    assert results["z2_cpu"]["total"]["tiers"] == {
        "cpu": {"budget_bytes": None, "used_bytes": HOST_STATE + 4 * NUMEL}}
    # stage 3 + cpu: the bf16 shards in host memory (2 B/param), nothing gathered after a step
    assert results["z3_cpu"]["total"]["tiers"] == {
        "cpu": {"budget_bytes": None, "used_bytes": HOST_STATE + 2 * NUMEL}}
    # stage 3 + nvme: the parameter store reports its own tiers (its budget: one 2048-element
    # bf16 buffer = 4096 B, max_in_cpu 0), and the host state comes on top of its CPU use
    r = results["z3_nvme"]
    store, tiers = r["store_tiers"], r["total"]["tiers"]
    assert store["cpu"]["budget_bytes"] == 4096
    assert tiers["cpu"] == {"budget_bytes": 4096,
                            "used_bytes": HOST_STATE + store["cpu"]["used_bytes"]}
    assert tiers["nvme"] == {"budget_bytes": store["nvme"]["budget_bytes"],
                             "used_bytes": store["nvme"]["used_bytes"]}


def test_stage3_nvme_reads_and_writes_every_shard_each_step(results):
    r = results["z3_nvme"]
    shard_bytes = 2 * sum(r["shard_numels"])  # bf16 shards of this rank (world 1)
    assert shard_bytes == 2 * NUMEL
    largest = 2 * max(r["shard_numels"])
    for i, s in enumerate(r["steps"]):
        moved = s["bytes_moved"]
        assert moved["nvme->cpu"] >= shard_bytes, (i, moved)  # forward reads every shard
        assert moved["nvme->cpu"] % (2 * (WIDTH * WIDTH + WIDTH)) == 0  # whole shards only
        # every shard is updated each step; all but the one the buffer still holds are
        # written back within the step, the last one at the next step's first eviction
        assert moved["cpu->nvme"] >= shard_bytes - largest, (i, moved)
        # publish allocated every shard without reading it, but the one the buffer may hold
        # (the prefetch thread decides whether it is still there)
        assert LAYERS - 1 <= s["overwrites"] <= LAYERS, (i, s)
        assert s["stall_seconds"] >= 0 and s["busy_seconds"] > 0
    after_first = r["steps"][1:]
    assert all(s["bytes_moved"]["cpu->nvme"] == shard_bytes for s in after_first)
    assert r["total"]["tiers"]["nvme"]["used_bytes"] >= shard_bytes
    _assert_totals_are_step_sums(r)


def test_overwrite_removes_the_publish_read(results):
    new, old = results["z3_nvme"], results["z3_nvme_no_overwrite"]
    shard = 2 * (WIDTH * WIDTH + WIDTH)
    reads_new = new["total"]["bytes_moved"]["nvme->cpu"]
    reads_old = old["total"]["bytes_moved"]["nvme->cpu"]
    assert old["total"]["overwrites"] == 0
    # the old path read every shard once more per step to overwrite it
    assert reads_old - reads_new >= STEPS * LAYERS * shard // 2, (reads_old, reads_new)
    assert new["total"]["bytes_moved"]["cpu->nvme"] == old["total"]["bytes_moved"]["cpu->nvme"]


# -- GPU (pytest -m gpu): host <-> device bytes ------------------------------------------------

def _gpu_body(tmpdir):
    res = {}
    # off; on with every chunk streamed (gpu_budget_bytes 0); on with the default budget,
    # where at this size every chunk the GPU steps stays resident ([Note: resident chunks])
    for assist, budget, tag in ((False, 0, ""), ("auto", 0, "_assist"),
                                ("auto", None, "_resident")):
        for name, stage, off_param in (("z2_cpu", 2, "none"), ("z3_cpu", 3, "cpu")):
            cfg = _config(stage, off_param, "cpu", tmpdir)
            # per-step hand counts: the step done within its step (with the overlap, CUDA's
            # default, a step's publication copies land in the next step's window)
            cfg["zero_optimization"]["tiering"] = {"step_assist": assist, "overlap_step": False}
            if budget is not None:  # unset: "auto"
                cfg["zero_optimization"]["tiering"]["gpu_budget_bytes"] = budget
            res[name + tag] = _train(cfg)
    return res


NORM = 4
"""Each step the local squared gradient norm, one fp32 scalar, comes to the host (taken on the
device while the gradients land: its 4 bytes are counted like every other crossing)."""
INIT = 4 * NUMEL
"""Stage 2's first step also holds the engine's construction: the fp32 masters are read from
the parameters, already on the GPU, into host memory once."""
SCALARS = 8
"""A step in which the step assist steps a chunk of the (one) optimizer group on the GPU also
sends that group's step counter and gradient scale there: two fp32 scalars, once."""


@pytest.mark.gpu
def test_host_device_bytes_on_gpu(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # torch's CPU Adam: fp32 host gradients, as in the CPU fixture's hand counts
    res = run_ranks(_gpu_body, 1, str(tmp_path), env={"ZEROIO_CPU_ADAM": "torch"})[0]
    # stage 2 cpu offload: each step the fp32 gradient shard goes down once, and the fp32
    # masters go up once (cast to bf16 on the GPU) -- or bf16 staging: 2 bytes
    z2 = res["z2_cpu"]
    assert z2["assisted"] == [0] * STEPS
    for i, s in enumerate(z2["steps"]):
        assert s["bytes_moved"]["gpu->cpu"] == 4 * NUMEL + NORM + (INIT if i == 0 else 0)
        assert s["bytes_moved"]["cpu->gpu"] in (4 * NUMEL, 2 * NUMEL)
    # stage 3 cpu: the fp32 gradient of every shard down once; every bf16 shard up for
    # forward and again for backward (reuse distance 0), nothing else
    z3 = res["z3_cpu"]
    for s in z3["steps"][1:]:
        assert s["bytes_moved"]["gpu->cpu"] == 4 * NUMEL + NORM
        assert 2 * NUMEL <= s["bytes_moved"]["cpu->gpu"] <= 2 * 2 * NUMEL
    # the step assist ([Note: step assist] in shard/assist.py): for each element the GPU
    # steps, master + exp_avg + exp_avg_sq (12 B) and the fp32 host gradient (4 B) go up and
    # the 12 B of state come back down; at stage 2 that element's 16-bit value is cast on the
    # GPU (no publication upload), at stage 3 it goes down to the host shard (2 B more)
    z2a = res["z2_cpu_assist"]
    assert sum(z2a["assisted"]) > 0, z2a["assisted"]
    for i, (s, a) in enumerate(zip(z2a["steps"], z2a["assisted"], strict=True)):
        moved = s["bytes_moved"]
        assert moved["gpu->cpu"] == 4 * NUMEL + 12 * a + NORM + (INIT if i == 0 else 0), (moved, a)
        up = moved["cpu->gpu"] - 16 * a - SCALARS * (a > 0)
        assert up in (4 * (NUMEL - a), 2 * (NUMEL - a)), (moved, a)
    z3a = res["z3_cpu_assist"]  # (at this size stage 3's host step may keep every chunk)
    for s, a in list(zip(z3a["steps"], z3a["assisted"], strict=True))[1:]:
        moved = s["bytes_moved"]
        assert moved["gpu->cpu"] == 4 * NUMEL + 14 * a + NORM, (moved, a)
        up = moved["cpu->gpu"] - 16 * a - SCALARS * (a > 0)
        assert 2 * NUMEL <= up <= 2 * 2 * NUMEL, (moved, a)
    # resident chunks, after the step that loaded them: the GPU has room, so the gradient
    # stays there ([Note: the gradient's home] in zeroio/config/accum_place.py): a GPU chunk
    # reads it where it is (nothing up), a CPU chunk through the host step's window (4 B
    # down); none of a GPU chunk's state comes down; at stage 3 its bf16 value still goes
    # down to the host shard (2 B). (At this size stage 3 may step every group on the
    # training thread, as above: a is 0 there.)
    assert sum(res["z2_cpu_resident"]["assisted"][1:]) > 0, res["z2_cpu_resident"]
    for name, down in (("z2_cpu_resident", 0), ("z3_cpu_resident", 2)):
        r = res[name]
        for s, a in list(zip(r["steps"], r["assisted"], strict=True))[1:]:
            moved = s["bytes_moved"]
            assert moved["gpu->cpu"] == 4 * (NUMEL - a) + down * a + NORM, (name, moved, a)
            up = moved["cpu->gpu"] - SCALARS * (a > 0)
            if down:  # the bf16 shards up for forward and backward
                assert 2 * NUMEL <= up <= 2 * 2 * NUMEL, (name, moved, a)
            else:  # the CPU chunks' publication
                assert up in (4 * (NUMEL - a), 2 * (NUMEL - a)), (name, moved, a)
    for r in res.values():
        _assert_totals_are_step_sums(r)
        _assert_breakdown_on_gpu(r)


def _assert_breakdown_on_gpu(r):
    """stats()["breakdown"] on a GPU: PCIe bytes each way are the window's "cpu->gpu" /
    "gpu->cpu" (checked against hand counts above), the GPU's chunks are the assist's count,
    the host step's chunks cover the shard, and the events gave GPU seconds."""
    for s, b, a in zip(r["steps"], r["breakdowns"], r["assisted"], strict=True):
        assert b["h2d_bytes"] == s["bytes_moved"].get("cpu->gpu", 0)
        assert b["d2h_bytes"] == s["bytes_moved"].get("gpu->cpu", 0)
        assert b["numel_gpu"] == a and b["numel_cpu"] + b["numel_gpu"] == NUMEL
        assert b["gpu_busy_s"] is not None and 0 < b["gpu_busy_s"] <= b["wall_s"]
        gpu = [c for c in b["chunks"] if c["device"] == "gpu"]
        assert sum(c["numel"] for c in gpu) == a
        assert (b["assist_gpu_s"] > 0) == (a > 0)
        for c in gpu:  # placed on the host clock after the step's norm sync
            assert 0 <= c["start"] <= c["end"]


def test_print_line_is_compact():
    from zeroio.engine import format_step_stats

    line = format_step_stats({"bytes_moved": {"cpu->gpu": 2_720_000_000, "nvme->cpu": 4_000_000},
                              "stall_seconds": 1.2034, "hidden_fraction": 0.71})
    assert line == "cpu->gpu 2.72GB nvme->cpu 4.00MB stall 1.203s hidden 71%"
    assert format_step_stats(None) == "no transfers"
    assert "hidden" not in format_step_stats({"bytes_moved": {}, "stall_seconds": 0.0,
                                              "hidden_fraction": None})
