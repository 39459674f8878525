"""A write-back that fails is raised promptly, naming the errno and the file, and loses nothing
([Note: a write-back that failed] in zeroio/tiering/mover.py; [Note: atomic step] in
zeroio/step_guard.py).

Two levels. The store: one write-behind fails and a later demand needs its room; it must get
the failure as a SwapIOError at once, not wait ``acquire_timeout_s`` for a release that cannot
come and then blame the budget; the dirty copy keeps its bytes and the next write-back stores
them (reference: the values written, read back raw from the backend). The engine: one
ENOSPC from the OS in a swap file's write; the step that wrote it or the next one raises a
SwapIOError (or, where the failure lands after that step began changing state, a
StepFailedError) naming ENOSPC and the file, and the training that follows (a retry of the
rolled-back step, or a load of the last checkpoint) equals an uninterrupted run bit for bit.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
import torch
from test_step_atomic import _config, _iteration, _model, _params, _swapped, _train

from zeroio.errors import CapacityError, SwapIOError
from zeroio.testing import run_ranks
from zeroio.testing.disk_faults import DiskFaults
from zeroio.tiering import MemoryBackend, Tier, TieredStore

PAGE = 4096
N = PAGE // 4  # float32 elements in one page
WAIT_S = 30.0
"""The store's ``acquire_timeout_s`` in the store test: a demand that waited it out would fail
with CapacityError after that long."""


def test_a_failed_write_behind_is_raised_to_the_demand_that_needs_its_room_and_loses_nothing():
    backend = MemoryBackend()
    store = TieredStore(None, backend=backend, policy="lru", prefetch_depth=0,
                        cpu_budget_bytes=2 * PAGE, nvme_budget_bytes=8 * PAGE,
                        acquire_timeout_s=WAIT_S)
    for name in "abc":
        store.register(name, (N,), torch.float32, home=Tier.NVME)
    try:
        t = store.acquire("a", Tier.CPU)
        t.copy_(torch.arange(N, dtype=torch.float32))
        store.mark_dirty("a", Tier.CPU)
        store.release("a", Tier.CPU)
        backend.fail_next("write", "a")
        store.evict("a", Tier.CPU)  # write-behind: nobody waits for it
        store.drain()
        store.acquire("b", Tier.CPU)  # the second slot
        t0, err = time.monotonic(), None
        try:
            store.acquire("c", Tier.CPU)  # needs a's slot: a's copy is kept for its error
        except (SwapIOError, CapacityError) as exc:
            err = exc
        waited = time.monotonic() - t0
        assert isinstance(err, SwapIOError), f"{type(err).__name__}: {err}"
        assert "writing back 'a'" in str(err) and "injected write failure" in str(err), err
        assert waited < WAIT_S, waited  # reported, not waited out
        store.release("b", Tier.CPU)
        # nothing lost: a's dirty copy still holds the values, and the disk gets them next time
        assert store.residency("a") == {"nvme": "clean", "cpu": "dirty"}
        store.acquire("c", Tier.CPU)  # a is a victim again: written back now
        store.release("c", Tier.CPU)
        store.flush()
        raw = np.frombuffer(bytes(backend._data["a"]), dtype=np.float32)
        assert np.array_equal(raw, np.arange(N, dtype=np.float32))
    finally:
        store.close()


def _enospc_phase(root, stage, write_behind):
    import zeroio
    from zeroio.errors import StepFailedError

    def engine(run):
        cfg = _config(1, stage, os.path.join(root, run), True)
        cfg["zero_optimization"]["offload_optimizer"]["pipeline_write"] = write_behind
        torch.manual_seed(0)
        e, *_ = zeroio.initialize(model=_model(), config=cfg)
        e.show_progress = False
        return e

    ref = engine("nvme-ref")
    straight = _train(ref, range(7))
    straight_params = _params(ref)
    ref.close()

    e = engine("nvme")
    losses = _train(e, range(3))
    e.save_checkpoint(os.path.join(root, "ck"), tag="base")
    faults = DiskFaults(e)
    paths = faults.enospc_once(_swapped(e).pieces[-1].name("exp_avg"))  # the last piece
    i, err, seconds = 3, None, None
    while i < 7 and err is None:
        t0 = time.monotonic()
        try:
            losses.append(_iteration(e, i))
            i += 1
            if write_behind:  # its write-behind lands during the next forward and backward,
                e.optimizer.drain()  # as it does wherever they take longer than a tiny write
        except (SwapIOError, StepFailedError) as exc:
            err, seconds = exc, time.monotonic() - t0
    failed_at = i
    faults.clear()
    rolled_back = isinstance(err, SwapIOError)
    if not rolled_back:  # refused: the documented remedy
        e.load_checkpoint(os.path.join(root, "ck"), tag="base")
        losses, i = losses[:3], 3
    losses += _train(e, range(i, 7))
    params = _params(e)
    e.close()
    cause = err if rolled_back else getattr(err, "__cause__", None)
    return {"straight": straight, "losses": losses, "failed_at": failed_at,
            "err": None if err is None else f"{type(err).__name__}: {err}", "seconds": seconds,
            "errno": getattr(cause, "errno", None), "paths": paths, "rolled_back": rolled_back,
            "equal": {k: bool(np.array_equal(params[k], v)) for k, v in straight_params.items()}}


@pytest.mark.parametrize("stage,write_behind", [(2, True), (3, True), (2, False)])
def test_one_enospc_on_a_write_back_is_raised_promptly_naming_it_and_training_stays_exact(
        tmp_path, stage, write_behind):
    (r,) = run_ranks(_enospc_phase, 1, str(tmp_path), stage, write_behind, timeout=300)
    assert r["err"] is not None, "the failed write-back was never reported"
    # step 3 updates the last piece first: it or the next step reports its write-back
    # (without write-behind it is written when step 4 needs its room: at the latest step 5)
    assert r["failed_at"] <= (4 if write_behind else 5), r
    assert "ENOSPC" in r["err"] and r["errno"] == errno.ENOSPC, r["err"]
    assert any(p in r["err"] for p in r["paths"]), (r["paths"], r["err"])
    assert "\n" not in r["err"], r["err"]
    assert r["seconds"] < 60, r["seconds"]  # not after acquire_timeout_s (120 s)
    if write_behind:  # the failure of the last step's write-behind: nothing changed yet
        assert r["failed_at"] == 4 and r["rolled_back"], r
    assert r["losses"] == r["straight"], (r["losses"], r["straight"])
    assert r["equal"] and all(r["equal"].values()), r["equal"]
