"""A rank whose optimizer update outlasts ``distributed.timeout_s``: the ranks' vote after the
update fails on both ranks, and neither engine may go on with its step applied but uncounted.

[Note: atomic step] in zeroio/step_guard.py. Rank 1's update is slowed past the process
group's timeout, so rank 0's vote times out and rank 1's, once it comes, finds the group
closed. References: each engine's masters and scalars before the step (the masters have
changed on every rank, the scalars are restored), and an uninterrupted run of the same model
and batches (losses and parameters, bit for bit) against a restart that loads the checkpoint
saved before the failed step.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from test_step_atomic import _batch, _masters, _params, _refusals, _scalars, _train

from zeroio.testing import run_ranks

TIMEOUT_S = 3.0
"""The process group's timeout in the faulty run (``distributed.timeout_s``)."""
SLOW_S = TIMEOUT_S + 4.0
"""How much longer rank 1's update takes: past the timeout and past rank 0's peer check."""

OFFLOADS = {"none": {"device": "none"}, "nvme": {"device": "nvme", "pipeline_read": True}}
"""Device masters (the whole step, then publication) and NVMe moments (ranges published)."""


def _engine(root: str, offload: str, stage: int, run: str):
    import torch.distributed as dist

    import zeroio

    block = dict(OFFLOADS[offload])
    if offload == "nvme":
        block["nvme_path"] = os.path.join(root, f"{run}-nvme{dist.get_rank()}")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                         "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage, "sub_group_size": 50,
                                 "offload_optimizer": block}}
    torch.manual_seed(0)
    engine, *_ = zeroio.initialize(model=torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5)), config=cfg)
    engine.show_progress = False
    return engine


def _slow_on_rank1(engine) -> None:
    import torch.distributed as dist

    if dist.get_rank() != 1:
        return
    step = engine.optimizer.step

    def slow_step(*args, **kw):
        out = step(*args, **kw)  # the update is applied, then the rank is late to the vote
        time.sleep(SLOW_S)
        return out

    engine.optimizer.step = slow_step


def _faulty_phase(root, offload, stage):
    import torch.distributed as dist

    from zeroio.errors import ZeroIOError

    rank = dist.get_rank()
    e = _engine(root, offload, stage, "faulty")
    first = _train(e, range(2))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    masters, before = _masters(e), _scalars(e)
    _slow_on_rank1(e)
    x, y = _batch(2, rank, dist.get_world_size())
    e.backward(torch.nn.functional.mse_loss(e(x), y))
    t0, err = time.monotonic(), None
    try:
        e.step()
    except ZeroIOError as exc:
        err = exc
    step_s = time.monotonic() - t0
    after = _scalars(e)
    changed = [not np.array_equal(a, b) for a, b in zip(masters, _masters(e), strict=True)]
    refused = _refusals(e, os.path.join(root, "ck"))
    load_err = None
    try:  # the world is gone: this load cannot work, and the engine must still refuse
        e.load_checkpoint(os.path.join(root, "ck"), tag="base")
    except ZeroIOError as exc:
        load_err = f"{type(exc).__name__}: {exc}"
    still = _refusals(e, os.path.join(root, "ck"))["step"]
    e.close()
    return {"first": first, "err": None if err is None else f"{type(err).__name__}: {err}",
            "rolled_back": getattr(err, "rolled_back", None), "step_s": step_s,
            "before": before, "after": after, "changed": changed, "refused": refused,
            "load_err": load_err, "still": still,
            "tags": sorted(os.listdir(os.path.join(root, "ck")))}


def _resume_phase(root, offload, stage):
    ref = _engine(root, offload, stage, "ref")
    straight = _train(ref, range(5))
    straight_params = _params(ref)
    ref.close()
    e = _engine(root, offload, stage, "resumed")
    e.load_checkpoint(os.path.join(root, "ck"), tag="base")
    rest = _train(e, range(2, 5))
    params = _params(e)
    e.close()
    return {"straight": straight, "rest": rest,
            "equal": {k: bool(np.array_equal(params[k], v)) for k, v in straight_params.items()}}


@pytest.mark.parametrize("offload,stage", [("none", 2), ("nvme", 3)])
def test_a_vote_that_times_out_leaves_both_engines_refusing_and_a_restart_resumes_exactly(
        tmp_path, offload, stage):
    results = run_ranks(_faulty_phase, 2, str(tmp_path), offload, stage,
                        collective_timeout_s=TIMEOUT_S, timeout=300)
    for rank, r in enumerate(results):
        # the scenario: every rank applied its update, and the vote on it failed
        assert all(r["changed"]), (rank, r["changed"])
        assert r["err"] is not None and r["err"].startswith("StepFailedError: "), (rank, r["err"])
        assert "vote on it failed" in r["err"] and "DistributedError" in r["err"], r["err"]
        assert "load a checkpoint" in r["err"] and "\n" not in r["err"], r["err"]
        assert r["rolled_back"] is False, rank
        assert r["step_s"] < 120, r["step_s"]  # the timeout and a peer check, not a hang
        assert r["after"] == r["before"], (rank, r["before"], r["after"])  # nothing counted
        for what, msg in r["refused"].items():
            assert msg.startswith("StepFailedError: ") and "vote on it failed" in msg, (what, msg)
        assert r["load_err"] is not None, rank  # no collective works in the dead world
        assert r["still"].startswith("StepFailedError: "), (rank, r["still"])
        assert r["tags"] == ["base", "latest"], r["tags"]  # no checkpoint of the applied step
    assert "stopped answering" in results[0]["err"] or "slow" in results[0]["err"], results[0]
    # the remedy: a restart that loads the checkpoint trains on as if nothing happened
    resumed = run_ranks(_resume_phase, 2, str(tmp_path), offload, stage, timeout=300)
    for r, faulty in zip(resumed, results, strict=True):
        assert faulty["first"] + r["rest"] == r["straight"]
    assert resumed[0]["equal"] and all(resumed[0]["equal"].values()), resumed[0]["equal"]
