"""The remedy a refused step names works: after a swap file is deleted or damaged, the step is
refused ("load a checkpoint"), ``load_checkpoint`` succeeds in the same process, and training
goes on exactly as an uninterrupted run from that checkpoint.

A load replaces every piece of NVMe-resident state whole, so it never reads the old swap files
(``replacing`` in zeroio/optim/swap.py, [Note: a load replaces pieces whole]). References: an
uninterrupted run of the same model and batches (losses and parameters, bit for bit); the
damaged files are the optimizer's own (deleted, or one byte flipped so the crc fails).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_step_atomic import _config, _iteration, _model, _params, _refusals, _swapped, _train

from zeroio.testing import run_ranks
from zeroio.testing.disk_faults import DiskFaults


def _engine(root: str, run: str, stage: int, masters: str):
    import torch.distributed as dist

    import zeroio

    world = dist.get_world_size()
    cfg = _config(world, stage, os.path.join(root, f"{run}{dist.get_rank()}"), True)
    cfg["zero_optimization"]["offload_optimizer"]["masters"] = masters
    torch.manual_seed(0)
    engine, *_ = zeroio.initialize(model=_model(), config=cfg)
    engine.show_progress = False
    return engine


def _remedy_phase(root, stage, masters, how):
    from zeroio.errors import StepFailedError

    ref = _engine(root, "nvme-ref", stage, masters)
    straight = _train(ref, range(6))
    straight_params = _params(ref)
    ref.close()

    e = _engine(root, "nvme", stage, masters)
    paged = _swapped(e).paged is not None
    first = _train(e, range(3))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    swapped = _swapped(e)
    # a streamed piece read after earlier ones were updated: the step cannot roll back
    bad = swapped.plan.resident + 1 + swapped.plan.read_ahead + 1
    kinds = ("master", "exp_avg", "exp_avg_sq") if paged else ("exp_avg", "exp_avg_sq")
    damaged = DiskFaults(e).damage({swapped.pieces[bad].name(k) for k in kinds}, how)
    err = None
    try:
        _iteration(e, 3)
    except StepFailedError as exc:
        err = exc
    refused = _refusals(e, os.path.join(root, "ck"))["step"]
    load_err, rest = None, []
    try:
        e.load_checkpoint(os.path.join(root, "ck"), tag="base")
        rest = _train(e, range(3, 6))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        load_err = f"{type(exc).__name__}: {exc}"
    params = _params(e) if load_err is None else {}
    e.close()
    return {"paged": paged, "pieces": len(swapped.pieces), "bad": bad, "damaged": damaged,
            "err": None if err is None else str(err), "rolled_back": getattr(err, "rolled_back", None),
            "refused": refused, "load_err": load_err, "straight": straight, "first": first,
            "rest": rest, "equal": {k: bool(np.array_equal(params.get(k), v))
                                    for k, v in straight_params.items()}}


CASES = [(2, 1, "host", "delete"), (3, 2, "host", "corrupt"), (2, 1, "nvme", "corrupt"),
         (3, 1, "nvme", "delete")]
"""(stage, ranks, offload_optimizer.masters, what happens to the swap file)."""


@pytest.mark.parametrize("stage,world,masters,how", CASES)
def test_a_damaged_swap_file_is_refused_and_a_checkpoint_load_in_the_same_process_recovers_exactly(
        tmp_path, stage, world, masters, how):
    results = run_ranks(_remedy_phase, world, str(tmp_path), stage, masters, how, timeout=300)
    for r in results:
        assert r["paged"] == (masters == "nvme"), r["paged"]
        assert r["bad"] < r["pieces"] and r["damaged"], r
        assert r["err"] is not None and r["rolled_back"] is False, r["err"]
        assert "load a checkpoint (engine.load_checkpoint) to continue" in r["err"], r["err"]
        assert r["refused"].startswith("StepFailedError"), r["refused"]
        assert r["load_err"] is None, r["load_err"]  # the documented remedy works
        assert r["first"] + r["rest"] == r["straight"], (r["first"], r["rest"], r["straight"])
    assert all(results[0]["equal"].values()), results[0]["equal"]
