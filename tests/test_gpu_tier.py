"""State resident on the GPU yields to training ([Note: resident state yields] in
zeroio/tiering/gpu_tier.py).

CPU (here): the peak model and the room by hand; a GPU tier whose capacity is injected and
shrinks evicts last admitted first, behind the step in flight (``quiesce``), and re-admits when
the room returns; the forward's out-of-memory retry; and inside a real gloo engine's step with
gradient accumulation, a holder whose chunks stand in for host optimizer state (the host copy
is poisoned while a chunk is "resident", made current on eviction) is evicted between
micro-batches and before the backward, so the run equals the one without any holder bit for
bit and ``engine.stats()`` reports the GPU tier and its evictions.

GPU (``-m gpu``): a real run whose batch grows from 1024 to 4096 tokens, resident chunks
evicted before the longer forward, equal bit for bit to ``gpu_budget_bytes: 0``.

On the GPU machine:  python3 -m pytest -q -m gpu tests/test_gpu_tier.py
"""

from __future__ import annotations

import pytest
import test_stage12_ratio as r12  # noqa: I001 (tests/ is on sys.path under pytest)
import torch

from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda
from zeroio.testing.models import mlp_batch, tiny_mlp
from zeroio.tiering.gpu_tier import DeviceMemory, GpuTier, PeakModel, batch_size


class Chunks:
    """A holder of ``n`` chunks of ``size`` bytes each (the assist's side of the protocol)."""

    def __init__(self, n, size, log):
        self.keys, self.size, self.log = list(range(n)), size, log
        self.budget = n * size

    def gpu_bytes(self):
        return len(self.keys) * self.size

    def claim_bytes(self):
        return self.gpu_bytes()

    def evict(self, nbytes):
        freed = 0
        while freed < nbytes and self.keys:
            self.log.append(("evict", self.keys.pop()))
            freed += self.size
        return freed

    def set_budget(self, nbytes):
        self.budget = nbytes


class Device:
    """An injected device: ``total`` changes under the test; this process reserves ``base`` plus
    what the holders hold; its peak is set by the test."""

    def __init__(self, tier, total, base, peak):
        self.tier, self.total, self.base, self.peak = tier, total, base, peak

    def __call__(self):
        reserved = self.base + self.tier.used_bytes
        return DeviceMemory(total=self.total, free=self.total - reserved, reserved=reserved,
                            peak_reserved=self.peak)


def test_peak_model_by_hand():
    m = PeakModel()
    assert m.predict(100) is None
    m.add(1000, 30)
    assert m.predict(1000) == 30 and m.predict(10) == 30  # smaller: at most the measured
    assert m.predict(4000) == 120  # in proportion above it
    m.add(4000, 150)  # a longer batch needed more per token than scaled
    assert m.predict(8000) == 300 and m.predict(5000) == 187  # from the largest ratio below
    assert m.predict(1000) == 30 and m.predict(2000) == 60  # a shorter batch: its own size
    assert m.predict(500) == 30
    assert batch_size((torch.zeros(3, 4),), {}) == 12
    assert batch_size((), {"input_ids": torch.zeros(2, 5, dtype=torch.long),
                           "mask": torch.zeros(9)}) == 10
    assert batch_size((1.0,), {}) == 1


def _tier(total=1000, peak=700):
    log = []
    tier = GpuTier(cap_bytes=None, margin=0.0, reserve_bytes=0,
                   auto_budget=lambda memory, resident, pending: 10_000)
    tier.memory = Device(tier, total, base=200, peak=peak)
    tier.quiesce = lambda: log.append(("quiesce",))
    chunks = Chunks(4, 100, log)
    tier.register(chunks)
    return tier, chunks, log


def test_shrinking_capacity_evicts_last_first_behind_the_step():
    tier, chunks, log = _tier()
    tier.before_forward(50)
    tier.after_backward()  # peak 700 with 400 resident: training needs 300 at 50 tokens
    assert tier.model.predict(50) == 300
    assert tier.before_forward(50) == 0 and not log  # 1000 - 300 = 700 >= 400
    tier.memory.total = 550  # another allocation: room 250 for 400 resident
    assert tier.before_backward() == 200
    assert log == [("quiesce",), ("evict", 3), ("evict", 2)]
    assert chunks.budget == 200  # nothing admitted again before the next step's budget
    assert tier.before_forward(100) == 200  # twice the tokens: 600 > 550, everything goes
    assert tier.stats()["evictions"] == 2 and tier.stats()["evicted_bytes"] == 400
    assert tier.stats()["tiers"]["gpu"] == {"budget_bytes": 0, "used_bytes": 0}
    # the next step's budget: what the last prediction leaves, then more when room returns
    assert tier.step_budget() == 0 and chunks.budget == 0
    tier.memory.total = 1500
    assert tier.step_budget() == 1500 - 600 and chunks.budget == 900
    # the long batch measured (peak 800, nothing resident): a short one again has room for
    # more than the long one leaves
    tier.memory.peak = 800
    tier.after_backward()
    assert tier.model.predict(100) == 800 and tier.step_budget() == 1500 - 800
    tier.before_forward(50)
    assert tier.step_budget() == 1500 - 300


def test_a_cap_and_zero():
    tier, chunks, _ = _tier()
    tier.cap_bytes = 0
    assert tier.step_budget() == 0
    tier.cap_bytes = 250
    assert tier.step_budget() == 250  # no measurement yet: the cap alone
    tier.before_forward(50)
    tier.after_backward()
    tier.memory.total = 400  # room 100 beside 300 of training
    assert tier.step_budget() == 100


def test_forward_out_of_memory_is_retried_once_with_nothing_resident():
    tier, chunks, log = _tier()
    emptied, calls = [], []
    tier.empty_cache = lambda: emptied.append(1)

    def forward():
        calls.append(tier.used_bytes)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return "out"

    assert tier.forward(forward, 10, rerunnable=True) == "out"
    assert calls == [400, 0] and emptied == [1] and tier.oom_retries == 1
    assert log[0] == ("quiesce",) and len(log) == 5
    calls.clear()
    with pytest.raises(torch.cuda.OutOfMemoryError):  # nothing left to give back
        tier.forward(forward, 10, rerunnable=True)
    tier, *_ = _tier()
    calls.clear()
    with pytest.raises(torch.cuda.OutOfMemoryError):  # a forward that may not run again
        tier.forward(forward, 10, rerunnable=False)


# ---- inside a real step (gloo) ---------------------------------------------------------------

class PoisonedMasters:
    """Chunks of the optimizer's real host masters standing in for resident chunks: while
    "resident", the host copy is stale (NaN) and the true values are here; ``evict`` makes
    the host copy current. A step that read a chunk still resident would train on NaN."""

    def __init__(self, master, n, log):
        self.master, self.log = master, log
        size = master.numel() // n
        self.chunks = {k: (k * size, master[k * size:(k + 1) * size].clone()) for k in range(n)}
        for lo, vals in self.chunks.values():
            master[lo:lo + vals.numel()] = float("nan")
        self.size = size * 4

    def gpu_bytes(self):
        return len(self.chunks) * self.size

    def claim_bytes(self):
        return self.gpu_bytes()

    def evict(self, nbytes):
        freed = 0
        while freed < nbytes and self.chunks:
            k = max(self.chunks)
            lo, vals = self.chunks.pop(k)
            self.master[lo:lo + vals.numel()] = vals
            self.log.append(k)
            freed += self.size
        return freed

    def set_budget(self, nbytes):
        pass


def _engine_body(mode, stage):
    import zeroio

    cfg = r12._config(stage, 1.0, gas=2)
    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    tier, log, seen, waits = engine.gpu_tier, [], [], []
    if mode != "none":
        holder = PoisonedMasters(engine.partitioner.groups[0].master, 4, log)
        tier.margin, tier.reserve_bytes = 0.0, 0
        size = holder.size
        device = Device(tier, total=10_000 * size, base=0, peak=4 * size + 3 * size)
        tier.memory = device
        tier.register(holder)
        real_wait = engine.partitioner.wait_step
        tier.quiesce = lambda: (waits.append(len(log)), real_wait())
    if mode == "oom":  # the second forward runs out of memory once
        calls = []

        def oom(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        engine.module.register_forward_pre_hook(oom)
    losses, error = [], None
    try:
        for step in range(2):
            total = 0.0
            for m in range(2):
                x, y = mlp_batch(step * 2 + m, 0)
                if mode == "pressure" and (step, m) == (0, 1):
                    device.total = 5 * size  # micro-batch 2: room for 2 chunks beside training
                loss = torch.nn.functional.mse_loss(engine(x), y)
                seen.append(("forward", step, m, len(log)))
                if mode == "pressure" and (step, m) == (0, 1):
                    device.total = 3 * size  # before its backward: room for none
                engine.backward(loss)
                seen.append(("backward", step, m, len(log)))
                engine.step()
                total += loss.item()
            losses.append(total)
    except torch.cuda.OutOfMemoryError as e:
        error = str(e)
    stats = engine.stats()
    out = {"losses": losses, "error": error, "tier": stats["sources"]["gpu_tier"],
           "tiers_gpu": stats["tiers"].get("gpu"), "log": log, "seen": seen, "waits": waits}
    if error is None:
        out["masters"] = r12._masters(engine).tolist()
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_eviction_inside_a_step_with_accumulation_keeps_the_run_exact(stage):
    (ref,) = run_ranks(_engine_body, 1, "none", stage, timeout=180)
    (got,) = run_ranks(_engine_body, 1, "pressure", stage, timeout=180)
    # micro-batch 2's forward: 2 chunks evicted, the last two first; its backward: the rest
    assert got["seen"][:4] == [("forward", 0, 0, 0), ("backward", 0, 0, 0),
                               ("forward", 0, 1, 2), ("backward", 0, 1, 4)], got["seen"]
    assert got["log"] == [3, 2, 1, 0]
    assert got["waits"] == [0, 2]  # each eviction behind the partitioner's wait_step
    tier = got["tier"]
    assert tier["evictions"] == 2 and tier["evicted_bytes"] > 0 and tier["oom_retries"] == 0
    assert got["tiers_gpu"]["used_bytes"] == 0 and ref["tiers_gpu"] is None
    # host copies made current before the step read them: the same run, bit for bit
    assert got["losses"] == ref["losses"]
    assert got["masters"] == ref["masters"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_forward_out_of_memory_runs_again_with_nothing_resident(stage):
    (got,) = run_ranks(_engine_body, 1, "oom", stage, timeout=180)
    if stage == 3:  # its hooks' state is not re-runnable: the error reaches the caller
        assert got["error"] and got["tier"]["oom_retries"] == 0 and got["log"] == []
        return
    (ref,) = run_ranks(_engine_body, 1, "none", stage, timeout=180)
    assert got["error"] is None and got["tier"]["oom_retries"] == 1
    assert got["log"] == [3, 2, 1, 0] and got["seen"][1:3] == [("backward", 0, 0, 0),
                                                             ("forward", 0, 1, 4)]
    assert got["losses"] == ref["losses"] and got["masters"] == ref["masters"]


# ---- GPU -------------------------------------------------------------------------------------

def _growing_body(stage):
    import os

    import test_step_assist as sa

    import zeroio
    from zeroio.partition import stage12
    from zeroio.shard import assist

    os.environ["ZEROIO_STEP_ASSIST"] = "1"
    os.environ["ZEROIO_CPU_ADAM"] = "compiled"
    os.environ["ZEROIO_STEP_CHUNK_NUMEL"] = "64"
    stage12.STEP_CHUNK_NUMEL = 64
    assist.SLOT_NUMEL = 32
    assist.BACKLOG_NUMEL = 1 << 40  # every chunk on the GPU: the same math in both runs
    out = {}
    for mode, budget in (("auto", None), ("none", 0)):
        cfg = sa._config(stage, "bf16", budget)
        torch.manual_seed(0)
        engine, *_ = zeroio.initialize(model=tiny_mlp(), config=cfg)
        tier = engine.gpu_tier
        losses = r12._train(engine, 2, 1, engine.device)
        resident_before = tier.used_bytes
        if mode == "auto":  # the device now has room for training and half the state only
            real, held = tier.memory, tier.used_bytes
            tier.memory = lambda real=real, held=held: _shrunk(real(), held // 2)
        losses += r12._train(engine, 2, 1, engine.device, first_step=2)
        stats = engine.stats()
        out[mode] = {"losses": losses, "masters": r12._masters(engine).tolist(),
                     "resident_before": resident_before, "tier": stats["sources"]["gpu_tier"],
                     "tiers_gpu": stats["tiers"].get("gpu")}
        engine.close()
    return out


def _shrunk(mem, left):
    """A reading whose device holds only ``left`` bytes beyond what training and the current
    resident state need at the peak."""
    total = mem.peak_reserved + left
    return DeviceMemory(total=total, free=max(0, total - mem.reserved), reserved=mem.reserved,
                        peak_reserved=mem.peak_reserved)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_resident_chunks_yield_on_the_gpu(stage):
    need_cuda(1)
    out, = run_ranks(_growing_body, 1, stage, timeout=300)
    auto, none = out["auto"], out["none"]
    assert auto["resident_before"] > 0 and none["resident_before"] == 0
    assert auto["tier"]["evictions"] >= 1 and auto["tier"]["evicted_bytes"] > 0, auto["tier"]
    assert auto["tier"]["tiers"]["gpu"] == {"budget_bytes": 0, "used_bytes": 0}, auto["tier"]
    assert auto["tiers_gpu"] is not None  # engine.stats()["tiers"] has the GPU tier
    # resident or streamed, evicted or not: the same fused Adam, bit for bit
    assert auto["losses"] == none["losses"]
    assert auto["masters"] == none["masters"]
