"""An optimizer step is atomic whatever fails it: a foreign error before any state changed,
a KeyboardInterrupt half-way through, an error on the worker of an overlapped host step.

[Note: atomic step] in zeroio/step_guard.py. References: an uninterrupted run of the same
model and batches (losses and parameters, bit for bit) and the engine's scalars before the
failed step. The swap faults (EIO, ENOSPC) are in test_step_atomic.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_step_atomic import _batch, _engine, _iteration, _params, _refusals, _scalars, _train

from zeroio.testing import run_ranks

# ---- a foreign error before the first update: rolled back, wrapped, the retry is exact --------


def _foreign_phase(root):
    from zeroio.errors import StepFailedError

    ref = _engine(1, 2, os.path.join(root, "nvme-ref"), True)
    straight = _train(ref, range(4))
    straight_params = _params(ref)
    ref.close()

    e = _engine(1, 2, os.path.join(root, "nvme"), True)
    first = _train(e, range(2))
    verify = e.optimizer._verify_first_reads

    def broken():
        raise RuntimeError("a worker of the optimizer died")

    e.optimizer._verify_first_reads = broken
    before = _scalars(e)
    err = None
    try:
        _iteration(e, 2)
    except StepFailedError as exc:
        err = exc
    after = _scalars(e)
    e.optimizer._verify_first_reads = verify
    rest = _train(e, range(2, 4))
    params = _params(e)
    e.close()
    return {"straight": straight, "first": first, "rest": rest, "before": before, "after": after,
            "err": str(err), "rolled_back": getattr(err, "rolled_back", None),
            "cause": type(getattr(err, "__cause__", None)).__name__,
            "equal": all(np.array_equal(params[k], v) for k, v in straight_params.items())}


def test_a_foreign_error_before_any_change_is_wrapped_and_rolled_back(tmp_path):
    (r,) = run_ranks(_foreign_phase, 1, str(tmp_path), timeout=300)
    assert r["rolled_back"] is True and r["cause"] == "RuntimeError", r["err"]
    assert "worker of the optimizer died" in r["err"] and "run its micro batches again" in r["err"]
    assert r["after"] == r["before"]
    assert r["first"] + r["rest"] == r["straight"] and r["equal"]


# ---- KeyboardInterrupt after pieces were updated: it stays a KeyboardInterrupt, the engine refuses


def _interrupt_phase(root):
    ref = _engine(1, 3, os.path.join(root, "nvme-ref"))
    straight = _train(ref, range(5))
    straight_params = _params(ref)
    ref.close()

    e = _engine(1, 3, os.path.join(root, "nvme"))
    first = _train(e, range(2))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    update, calls = e.optimizer._update, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return update(*args, **kw)

    e.optimizer._update = interrupted
    before = _scalars(e)
    kind = None
    try:
        _iteration(e, 2)
    except KeyboardInterrupt:
        kind = "KeyboardInterrupt"
    after = _scalars(e)
    e.optimizer._update = update
    refused = _refusals(e, os.path.join(root, "ck"))
    e.load_checkpoint(os.path.join(root, "ck"), tag="base")
    rest = _train(e, range(2, 5))
    params = _params(e)
    e.close()
    return {"kind": kind, "before": before, "after": after, "refused": refused,
            "straight": straight, "first": first, "rest": rest,
            "equal": all(np.array_equal(params[k], v) for k, v in straight_params.items())}


def test_keyboard_interrupt_half_way_keeps_its_type_and_the_engine_refuses_until_a_load(tmp_path):
    (r,) = run_ranks(_interrupt_phase, 1, str(tmp_path), timeout=300)
    assert r["kind"] == "KeyboardInterrupt" and r["after"] == r["before"]
    for what, msg in r["refused"].items():
        assert msg.startswith("StepFailedError") and "KeyboardInterrupt" in msg, (what, msg)
    assert r["first"] + r["rest"] == r["straight"] and r["equal"]


# ---- the worker of an overlapped host step fails: caught in the next call, the engine refuses ---


def _overlap_engine(stage):
    import zeroio

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "offload_optimizer": {"device": "cpu"},
                                 "tiering": {"overlap_step": True}}}
    engine, *_ = zeroio.initialize(model=torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5)), config=cfg)
    engine.show_progress = False
    return engine


def _overlap_phase(root, stage):
    from zeroio.errors import StepFailedError
    from zeroio.optim.adam import ShardedAdam

    ref = _overlap_engine(stage)
    straight = _train(ref, range(5))
    ref.synchronize()
    straight_params = _params(ref)
    ref.close()

    e = _overlap_engine(stage)
    overlapped = e.partitioner.runs_host_step and e.optimizer.chunked_step
    first = _train(e, range(2))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    begin = ShardedAdam.begin_chunked_step

    def failing_begin(self, grad_scale=1.0):
        chunked = begin(self, grad_scale)
        update, seen = chunked.update, []

        def update_then_fail(*args, **kw):
            seen.append(1)
            if len(seen) == 1:  # the first chunk (a small model has one or two)
                raise ValueError("CPU Adam worker fault")
            update(*args, **kw)

        chunked.update = update_then_fail
        return chunked

    ShardedAdam.begin_chunked_step = failing_begin
    where, err = None, None
    x, y = _batch(2, 0, 1)
    try:
        where = "backward"
        engine_loss = torch.nn.functional.mse_loss(e(x), y)
        e.backward(engine_loss)
        where = "step"
        e.step()
        where = "next forward"
        x, y = _batch(3, 0, 1)
        e(x)
        where = None
    except StepFailedError as exc:
        err = exc
    ShardedAdam.begin_chunked_step = begin
    refused = _refusals(e, os.path.join(root, "ck"))
    e.load_checkpoint(os.path.join(root, "ck"), tag="base")
    rest = _train(e, range(2, 5))
    e.synchronize()
    params = _params(e)
    e.close()
    return {"overlapped": overlapped, "where": where, "err": str(err),
            "cause": type(getattr(err, "__cause__", None)).__name__, "refused": refused,
            "straight": straight, "first": first, "rest": rest,
            "equal": all(np.array_equal(params[k], v) for k, v in straight_params.items())}


@pytest.mark.parametrize("stage", [2, 3])
def test_an_overlapped_step_failing_on_its_worker_is_caught_later_and_refused(tmp_path, stage):
    (r,) = run_ranks(_overlap_phase, 1, str(tmp_path), stage, timeout=300)
    assert r["overlapped"], "the config did not give an overlapped host step"
    assert r["where"] in ("step", "next forward"), r
    assert "CPU Adam worker fault" in r["err"] and "load a checkpoint" in r["err"], r["err"]
    assert r["cause"] == "ValueError", r["cause"]
    for what, msg in r["refused"].items():
        assert msg.startswith("StepFailedError") and "CPU Adam worker fault" in msg, (what, msg)
    assert r["first"] + r["rest"] == r["straight"] and r["equal"]
