"""An optimizer step is atomic (DESIGN.md; [Note: atomic step] in zeroio/step_guard.py).

Faults are injected into the swap backend of the NVMe optimizer (reads failing with EIO,
write-backs failing with ENOSPC) and into the optimizer itself. References: an uninterrupted
run of the same model and batches (losses and parameters, bit for bit), the engine's scalars
before the failed step, and the checkpoint folder's contents.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from zeroio.testing import run_ranks
from zeroio.testing.disk_faults import DiskFaults

BATCH = 4


def _model():
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "lamb": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "lamb_ratio": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
RATIO = {"lamb_ratio": 0.5}
"""Optimizers whose NVMe host side shares the shard with a device side (a ratio)."""


def _config(world: int, stage: int, nvme: str, read_ahead: bool = False,
            optimizer: str = "adamw") -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZERS[optimizer],
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                      "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage,
                              # a ratio's host side holds half the shard: smaller pieces
                              "sub_group_size": 10 if optimizer in RATIO else 50,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                                    "pipeline_read": read_ahead,
                                                    "ratio": RATIO.get(optimizer, 1.0)},
                              # a host share smaller than the moments: pieces stream to disk
                              "tiering": {"cpu_budget_bytes": 30000}},
    }


def _engine(world, stage, nvme, read_ahead=False, optimizer="adamw"):
    import zeroio

    torch.manual_seed(0)
    engine, *_ = zeroio.initialize(model=_model(),
                                   config=_config(world, stage, nvme, read_ahead, optimizer))
    engine.show_progress = False
    return engine


def _batch(i: int, rank: int, world: int):
    per = BATCH // world
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _iteration(engine, i: int) -> float:
    import torch.distributed as dist

    x, y = _batch(i, dist.get_rank(), dist.get_world_size())
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    t = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _train(engine, steps) -> list[float]:
    return [_iteration(engine, i) for i in steps]


def _params(engine) -> dict[str, np.ndarray]:
    from zeroio.checkpoint.export16 import gather_weights

    return {n: t.numpy().copy() for n, t in (gather_weights(engine) or {}).items()}


def _masters(engine) -> list[np.ndarray]:
    return [engine.optimizer.local_tensor(g.group_index, "fp32").detach().cpu().clone().numpy()
            for g in engine.partitioner.groups]


def _scalars(engine) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "lr": engine.get_lr(),
            "loss_scale": engine.loss_scaler.scale,
            "sched": engine.lr_scheduler.state_dict(),
            "opt_steps": [engine.optimizer.steps_taken(g.group_index)
                          for g in engine.partitioner.groups]}


def _swapped(engine):
    """The optimizer that swaps the state (a ratio's host side)."""
    from zeroio.optim.twin import TwinAdam

    opt = engine.optimizer
    return opt.host if isinstance(opt, TwinAdam) else opt


def _names(engine, pieces) -> set[str]:
    return {_swapped(engine).pieces[i].name(k) for i in pieces for k in ("exp_avg", "exp_avg_sq")}


def _refusals(engine, save_dir) -> dict[str, str]:
    """What each call raises on an engine that must refuse (the error's type and message)."""
    from zeroio.errors import StepFailedError

    x, y = _batch(0, 0, engine.world_size)
    out = {}
    calls = {
        "forward": lambda: engine(x),
        "backward": lambda: engine.backward(torch.ones((), requires_grad=True) * 2),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(save_dir, tag="after_failure"),
    }
    for what, call in calls.items():
        try:
            call()
            out[what] = "accepted"
        except StepFailedError as e:
            out[what] = f"StepFailedError: {e}"
    return out


# ---- a read fails in the middle of a step: the engine refuses until a load --------------------


def _mid_step_phase(root, stage, read_ahead, only_rank0=False):
    import torch.distributed as dist

    from zeroio.errors import StepFailedError, SwapIOError

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _engine(world, stage, os.path.join(root, f"nvme-ref{rank}"), read_ahead)
    straight = _train(ref, range(6))
    straight_params = _params(ref)
    ref.close()

    e = _engine(world, stage, os.path.join(root, f"nvme{rank}"), read_ahead)
    first = _train(e, range(3))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    faults = DiskFaults(e)
    n = len(e.optimizer.pieces)
    # the resident head is never read; the first window (piece ``resident`` and its read-ahead)
    # is read before any update: the pieces after it are read after earlier ones were updated
    window = e.optimizer.plan.resident + 1 + e.optimizer.plan.read_ahead
    if rank == 0 or not only_rank0:
        faults.fail_reads(_names(e, range(window + 1, n)))
    before = _scalars(e)
    err = None
    try:
        _iteration(e, 3)
    except StepFailedError as exc:
        err = exc
    after = _scalars(e)
    refused = _refusals(e, os.path.join(root, "ck"))
    tags = sorted(os.listdir(os.path.join(root, "ck")))
    with open(os.path.join(root, "ck", "latest")) as fh:
        latest = fh.read().strip()
    faults.clear()  # the disk is back: only a load makes the engine usable again
    still = _refusals(e, os.path.join(root, "ck"))["step"]
    e.load_checkpoint(os.path.join(root, "ck"), tag="base")
    rest = _train(e, range(3, 6))
    params = _params(e)
    e.close()
    return {"n_pieces": n, "window": window, "straight": straight, "first": first, "rest": rest,
            "err": None if err is None else str(err),
            "rolled_back": None if err is None else err.rolled_back,
            "cause_swap": isinstance(getattr(err, "__cause__", None), SwapIOError),
            "before": before, "after": after, "refused": refused, "tags": tags,
            "latest": latest, "still": still,
            "params_equal": {k: bool(np.array_equal(params[k], v))
                             for k, v in straight_params.items()} if rank == 0 else {}}


CASES = [(2, 1, False), (2, 1, True), (3, 2, False), (3, 2, True)]
"""(stage, ranks, pipeline_read): pieces read on demand, or three ahead of the update."""


@pytest.mark.parametrize("stage,world,read_ahead", CASES)
def test_a_read_failing_mid_step_refuses_until_a_load_then_trains_exactly(tmp_path, stage, world,
                                                                          read_ahead):
    results = run_ranks(_mid_step_phase, world, str(tmp_path), stage, read_ahead, timeout=300)
    r = results[0]
    assert r["n_pieces"] > r["window"] + 1, r  # some pieces are read after others were updated
    assert r["err"] is not None and r["rolled_back"] is False and r["cause_swap"], r["err"]
    assert "load a checkpoint (engine.load_checkpoint) to continue" in r["err"]
    # scalars as before the step: no counted step, no scheduler or optimizer count moved
    assert r["after"] == r["before"], (r["before"], r["after"])
    for what, msg in r["refused"].items():
        assert msg.startswith("StepFailedError: ") and "load a checkpoint" in msg, (what, msg)
        assert "global step 3" in msg, msg
    assert r["still"].startswith("StepFailedError")  # the disk coming back changes nothing
    assert r["tags"] == ["base", "latest"] and r["latest"] == "base"  # no checkpoint of it
    # the load restores the state before the failed step: the rest is the uninterrupted run
    assert r["first"] + r["rest"] == r["straight"]
    assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]
    for other in results[1:]:  # every rank refuses, and trains on exactly after the load
        assert other["err"] is not None and other["rolled_back"] is False, other["err"]
        assert other["first"] + other["rest"] == other["straight"]


def test_a_read_failing_on_one_rank_only_makes_every_rank_refuse(tmp_path):
    """Rank 1's step succeeds, rank 0's fails half-way: the ranks' vote after the update makes
    rank 1 refuse too (it cannot undo its step), and nobody waits in the publication."""
    r0, r1 = run_ranks(_mid_step_phase, 2, str(tmp_path), 2, True, True, timeout=300)
    assert r0["err"] is not None and r0["cause_swap"] and r0["rolled_back"] is False, r0["err"]
    assert r1["err"] is not None and "failed on another rank" in r1["err"], r1["err"]
    assert "load a checkpoint (engine.load_checkpoint) to continue" in r1["err"]
    for r in (r0, r1):
        assert r["after"] == r["before"]
        assert all(m.startswith("StepFailedError") for m in r["refused"].values()), r["refused"]
        assert r["first"] + r["rest"] == r["straight"]
    assert r0["params_equal"] and all(r0["params_equal"].values()), r0["params_equal"]


# ---- a read fails before anything changed: the step rolls back, the retry is exact -----------


def _first_window_phase(root, stage, read_ahead, optimizer="adamw"):
    import torch.distributed as dist

    from zeroio.errors import SwapIOError

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _engine(world, stage, os.path.join(root, f"nvme-ref{rank}"), read_ahead, optimizer)
    straight = _train(ref, range(5))
    straight_params = _params(ref)
    ref.close()

    e = _engine(world, stage, os.path.join(root, f"nvme{rank}"), read_ahead, optimizer)
    first = _train(e, range(2))
    masters = _masters(e)
    faults = DiskFaults(e)
    swapped = _swapped(e)
    ahead, head = swapped.plan.read_ahead, swapped.plan.resident
    streamed = len(swapped.pieces) - 1 > head + ahead
    # the resident head is never read; the end of a step starts reading the next ``ahead``
    # streamed pieces, and the next step reads the one after them itself, in its first window,
    # before it updates piece 0 (on demand: the first streamed piece, before its update).
    # Lamb reads every piece in its norm pass, which writes nothing: its last piece fails
    # there, before any update.
    bad = head + ahead if optimizer == "adamw" else len(swapped.pieces) - 1
    assert bad >= head + ahead, (bad, head, ahead)
    faults.fail_reads(_names(e, [bad]))
    before = _scalars(e)
    err = None
    try:
        _iteration(e, 2)
    except SwapIOError as exc:
        err = exc
    after = _scalars(e)
    same_masters = all(np.array_equal(a, b) for a, b in zip(masters, _masters(e), strict=True))
    faults.clear()
    rest = _train(e, range(2, 5))  # the same iteration again, then on
    params = _params(e)
    e.close()
    return {"ahead": ahead, "straight": straight, "first": first, "rest": rest,
            "streamed_after_window": streamed,
            "err": None if err is None else f"{type(err).__name__}: {err}",
            "before": before, "after": after, "same_masters": same_masters,
            "params_equal": {k: bool(np.array_equal(params[k], v))
                             for k, v in straight_params.items()} if rank == 0 else {}}


@pytest.mark.parametrize("stage,world,read_ahead", CASES)
def test_a_read_failing_before_the_first_update_rolls_back_and_the_retry_is_exact(tmp_path, stage,
                                                                                  world, read_ahead):
    r, *_ = run_ranks(_first_window_phase, world, str(tmp_path), stage, read_ahead, timeout=300)
    assert (r["ahead"] > 0) == read_ahead, r
    assert r["err"] is not None and "injected read error" in r["err"], r["err"]
    assert r["after"] == r["before"] and r["same_masters"], (r["before"], r["after"])
    assert r["first"] + r["rest"] == r["straight"]
    assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]


@pytest.mark.parametrize("stage,read_ahead,optimizer", [(2, True, "lamb"), (3, False, "lamb"),
                                                       (3, True, "lamb_ratio")])
def test_a_lamb_read_failing_in_its_norm_pass_rolls_back_and_the_retry_is_exact(tmp_path, stage,
                                                                                read_ahead,
                                                                                optimizer):
    """Lamb on NVMe reads every piece before it updates one ([Note: two passes over swapped
    Lamb moments]): a read of its last piece failing rolls the step back, as a first-window
    read does for Adam, and the retry gives the uninterrupted run's numbers. With a ratio the
    host side's norm pass runs before the device side changes anything."""
    r, *_ = run_ranks(_first_window_phase, 2, str(tmp_path), stage, read_ahead, optimizer,
                      timeout=300)
    assert r["streamed_after_window"], r  # the failing piece lies past the first window
    assert r["err"] is not None and "injected read error" in r["err"], r["err"]
    assert r["after"] == r["before"] and r["same_masters"], (r["before"], r["after"])
    assert r["first"] + r["rest"] == r["straight"]
    assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]


# ---- ENOSPC on write-back after a shared (hard-linked) save, then space freed -----------------


def _enospc_phase(root):
    import torch.distributed as dist

    from zeroio.errors import StepFailedError, SwapIOError
    from zeroio.io import links

    def refuse(src_fd, dst):
        raise OSError(errno.EOPNOTSUPP, "reflink disabled by the test")

    links._reflink = refuse  # ext4-like: the save hard-links the swap files
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _engine(world, 2, os.path.join(root, f"nvme-ref{rank}"), True)
    straight = _train(ref, range(7))
    straight_params = _params(ref)
    ref.close()

    e = _engine(world, 2, os.path.join(root, f"nvme{rank}"), True)
    first = _train(e, range(3))
    e.save_checkpoint(os.path.join(root, "ck"), tag="t")
    mode = e.last_save["mode"], e.last_save.get("files_hardlinked")
    faults = DiskFaults(e)
    faults.full = True
    errors, i = [], 3
    while i < 6:  # the write-backs fail: the step that sees it raises, nothing more is accepted
        try:
            _iteration(e, i)
            i += 1
        except (StepFailedError, SwapIOError) as exc:
            errors.append((type(exc).__name__, str(exc), getattr(exc, "rolled_back", None)))
            break
    refused = _refusals(e, os.path.join(root, "ck2"))
    faults.clear()  # space freed
    e.load_checkpoint(os.path.join(root, "ck"), tag="t")
    rest = _train(e, range(3, 7))
    params = _params(e)
    e.close()
    return {"mode": mode, "straight": straight, "first": first, "rest": rest, "errors": errors,
            "refused": refused, "ck2": os.path.exists(os.path.join(root, "ck2", "after_failure")),
            "params_equal": {k: bool(np.array_equal(params[k], v))
                             for k, v in straight_params.items()} if rank == 0 else {}}


def test_enospc_on_write_back_after_a_linked_save_then_space_freed_trains_on_after_a_load(tmp_path):
    (r,) = run_ranks(_enospc_phase, 1, str(tmp_path), timeout=300)
    assert r["mode"][0] == "shared" and r["mode"][1] > 0, r["mode"]
    assert len(r["errors"]) == 1, r["errors"]
    name, msg, rolled_back = r["errors"][0]
    assert "No space left" in msg, msg
    if rolled_back is False or name == "StepFailedError":
        assert "load a checkpoint" in msg
        assert all(m.startswith("StepFailedError") for m in r["refused"].values()), r["refused"]
        assert not r["ck2"]
    # after the load (space freed) no old ENOSPC comes back and training is exact
    assert r["first"] + r["rest"] == r["straight"]
    assert r["params_equal"] and all(r["params_equal"].values()), r["params_equal"]
