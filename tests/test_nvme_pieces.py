"""Swap pieces stay large and everything that touches them is linear ([Note: pieces stay large]
in zeroio/shard/swap_rule.py); a failed initialize leaves nvme_path as it was ([Note: a failed
initialize leaves no files] in zeroio/engine_build.py).

References: the zarr arrays on disk (counted and read from their metadata) against the
piece arithmetic done by hand; the bytes each master array is written with during
initialize; the number of Python calls one registration makes at N and at 4N registered
tensors; a directory listing of nvme_path before and after a refused initialize.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from zeroio.testing import run_ranks

LAYERS, WIDTH = 4, 2048
NUMEL = LAYERS * WIDTH * WIDTH  # 16.8M parameters, one optimizer group (no biases)
MIN_PIECE = 1 << 21  # zeroio.shard.swap_rule.MIN_PIECE_ELEMS, by hand
FP32 = 4
OLD_HELD = NUMEL * FP32 + WIDTH * WIDTH * FP32
"""What the host kept outside the stores before gradients paged: the fp32 gradient shard and
the parameter store's floor (one buffer of the largest shard, max_in_cpu 0)."""
BUDGET = OLD_HELD + 150_000
"""A quarter of the optimizer state (12 bytes per parameter: 201 MB) and just above
``OLD_HELD``: the optimizer's share used to be 150 kB, which the old rule (the window a
quarter of the share, pieces floored at a page) cut into 3125-element (12 kB) pieces: 5,400
of them, 16,000 zarr arrays."""


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                 for _ in range(LAYERS)])


def _config(nvme: str, budget: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "masters": "nvme"},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
            "tiering": {"cpu_budget_bytes": budget, "nvme_reserve_bytes": 0}},
    }


def _arrays(root: str) -> list[dict]:
    """Every zarr array under ``root``: its tensor name and shape, from its metadata."""
    out = []
    for d, _, files in os.walk(root):
        if "zarr.json" in files:
            meta = json.load(open(os.path.join(d, "zarr.json")))
            if meta.get("node_type") == "array":
                out.append({"name": meta["attributes"].get("tensor_name"),
                            "shape": meta["shape"]})
    return out


def _pieces_phase(nvme):
    import zeroio
    from zeroio.tiering.nvme import TensorStoreBackend

    writes: dict[str, int] = {}
    real_write = TensorStoreBackend.write

    def counted(self, name, tensor):
        writes[name] = writes.get(name, 0) + 1
        return real_write(self, name, tensor)

    TensorStoreBackend.write = counted
    try:
        engine, *_ = zeroio.initialize(model=_model(), config=_config(nvme, BUDGET))
    finally:
        TensorStoreBackend.write = real_write
    engine.show_progress = False
    optim = [a for a in _arrays(os.path.join(nvme, "zeroio-optim-rank0"))]
    folders = sorted(os.listdir(nvme))
    plan = engine.stats()["sources"]["optimizer"]["swap_plan"]
    opt, moved = engine.optimizer, []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(2, WIDTH, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        opt.drain()
        moved.append(dict(opt.store.stats()["bytes_moved"]))
    tiers = engine.stats()["tiers"]["cpu"]
    estimate = {i.name: (i.tier, i.bytes_per_gpu) for i in engine.placement.estimate.items}
    pools = {"optimizer": opt.store.held_host_bytes(),
             "params": engine.partitioner.store.store.held_host_bytes(),
             "shares": (opt.plan.cpu_budget, engine.partitioner.store.store.budgets.cpu)}
    engine.close()
    return {"arrays": optim, "folders": folders, "plan": plan,
            "master_writes": {n: c for n, c in writes.items() if n.endswith(".master")},
            "moved": [{k: b.get(k, 0) - a.get(k, 0) for k in ("nvme->cpu", "cpu->nvme")}
                      for a, b in zip(moved, moved[1:], strict=False)],
            "cpu_used": tiers["used_bytes"], "cpu_budget": tiers["budget_bytes"],
            "estimate": estimate, "pools": pools}


def test_pieces_stay_large_at_a_budget_that_used_to_cut_them_to_pages(tmp_path):
    r, = run_ranks(_pieces_phase, 1, str(tmp_path / "nvme"), timeout=600)
    # by hand: the window takes a quarter of the budget, which asks for fewer elements than the
    # floor, so every piece is the floor (8 MiB of each fp32 tensor) and 16.8M / 2M = 8 of them
    assert BUDGET // (4 * 6 * 2) < MIN_PIECE and NUMEL % MIN_PIECE == 0
    pieces = NUMEL // MIN_PIECE
    kinds = sorted({a["name"].rsplit(".", 1)[1] for a in r["arrays"]})
    assert kinds == ["exp_avg", "exp_avg_sq", "grad", "master"], kinds
    assert len(r["arrays"]) == 4 * pieces, len(r["arrays"])  # linear in the state
    assert all(a["shape"] == [MIN_PIECE] for a in r["arrays"]), r["arrays"][:3]
    assert r["plan"]["pieces"] == pieces and r["plan"]["kinds"] == [
        "master", "grad", "exp_avg", "exp_avg_sq"]
    # the initial masters reach the disk once, into the optimizer's own files: no second folder
    assert len(r["master_writes"]) == pieces and set(r["master_writes"].values()) == {1}
    assert r["folders"] == ["stage3-params-rank0", "zeroio-optim-rank0"], r["folders"]
    # a step moves what the swap plan says, each way, and host memory stays in the budget
    for moved in r["moved"]:
        for way in ("nvme->cpu", "cpu->nvme"):
            assert 0 < moved[way] <= 1.1 * r["plan"]["streamed_bytes_each_way"], (moved, r["plan"])
    assert r["cpu_used"] <= r["cpu_budget"] == BUDGET


def test_host_bytes_of_the_nvme_placement_by_hand(tmp_path):
    """The same run's host memory, counted by hand ([Note: budgets in training] in
    zeroio/tiering/budget.py, zeroio/config/host_split.py), against the estimate the engine
    decided its placement from and the stores' shares and pools: nothing is held outside the
    stores; the optimizer's floor is one piece of master, gradient and moments (16 bytes an
    element) and the gradient landing's two open pieces (one optimizer group, and one more);
    the parameter store asks for more than the rest, so it gets the rest."""
    r, = run_ranks(_pieces_phase, 1, str(tmp_path / "nvme"), timeout=600)
    optimizer = MIN_PIECE * 16 + 2 * MIN_PIECE * FP32
    params = BUDGET - optimizer
    est = r["estimate"]
    assert est["parameter swap buffers (pinned)"] == ("cpu", params)
    assert est["optimizer swap window (pinned)"] == ("cpu", MIN_PIECE * 16)
    assert est["gradient landing pieces (pinned)"] == ("cpu", 2 * MIN_PIECE * FP32)
    assert est["gradients"] == ("nvme", NUMEL * FP32)
    assert sum(b for t, b in est.values() if t == "cpu") == BUDGET
    assert r["pools"]["shares"] == (optimizer, params)  # the engine's split is the estimate's
    # what the stores allocated: within their shares, and within 15% of them after 3 steps
    # (the second landing piece is only taken while a write-back is slower than the landing)
    held = r["pools"]["optimizer"] + r["pools"]["params"]
    assert r["pools"]["optimizer"] <= optimizer and r["pools"]["params"] <= params
    assert 0.85 * BUDGET <= held <= BUDGET, (held, BUDGET)


def _calls_per_registration(count: int) -> float:
    """Python calls (profiler events) per ``register`` of one more NVMe-homed tensor, measured
    over 200 registrations after ``count`` are registered already."""
    from zeroio.tiering import Tier, TieredStore
    from zeroio.tiering.backend import MemoryBackend

    store = TieredStore(backend=MemoryBackend(), gpu_budget_bytes=0, cpu_budget_bytes=1 << 20,
                        nvme_budget_bytes=1 << 40, prefetch_depth=0)
    try:
        for i in range(count):
            store.register(f"t{i}", (16,), torch.float32, home=Tier.NVME)
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            calls += event in ("call", "c_call")

        sys.setprofile(profile)
        try:
            for i in range(200):
                store.register(f"u{i}", (16,), torch.float32, home=Tier.NVME)
        finally:
            sys.setprofile(None)
        return calls / 200
    finally:
        store.close()


def test_registration_costs_the_same_at_n_and_4n_tensors():
    """Counted, not timed: one registration makes as many calls with 4000 tensors registered
    as with 1000 (it used to scan every entry for the largest NVMe home: ~4x the calls)."""
    at_n, at_4n = _calls_per_registration(1000), _calls_per_registration(4000)
    assert at_4n <= 1.05 * at_n, (at_n, at_4n)
    assert at_n < 1000, at_n  # nothing proportional to the 1000 entries


def _refused_phase(nvme, budget):
    import zeroio
    from zeroio.errors import CapacityError

    try:
        zeroio.initialize(model=_model(), config=_config(nvme, budget))
    except CapacityError as exc:
        return str(exc)
    return None


def _listing(root: str) -> list[str]:
    if not os.path.exists(root):
        return ["<absent>"]
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.mark.parametrize("existing", [True, False])
def test_a_refused_initialize_leaves_nvme_path_as_it_was(tmp_path, existing):
    """The parameter shards and the initial masters are on disk when the host budget's split
    refuses (one piece's window does not fit): every file zeroio wrote goes, a file of the
    user's stays, and a folder that was not there is not there after."""
    nvme = tmp_path / "nvme" / "deeper"
    if existing:
        nvme.mkdir(parents=True)
        (nvme / "users-file.txt").write_text("mine")
    before = _listing(str(tmp_path))
    err, = run_ranks(_refused_phase, 1, str(nvme), 30_000_000, timeout=600)
    assert err is not None and "cpu_budget_bytes" in err, err
    assert _listing(str(tmp_path)) == before


def test_initialize_bars_follow_the_quiet_switch():
    """The masters' bar shows on rank 0 unless a caller with a quiet switch (zeroio train
    --quiet / --json, the Trainer's disable_tqdm) runs initialize under ``progress.quiet``."""
    from zeroio.io import progress

    assert not progress.bar(total=1, desc="t", show=True).disable
    assert progress.bar(total=1, desc="t", show=False).disable  # not rank 0
    with progress.quiet():
        assert progress.bar(total=1, desc="t", show=True).disable
    with progress.quiet(False):
        assert not progress.bar(total=1, desc="t", show=True).disable
