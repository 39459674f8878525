"""Host optimizer state the step assist keeps on the GPU between steps ([Note: resident
chunks] in zeroio/shard/assist.py; ``zero_optimization.tiering.gpu_budget_bytes``).

CPU (here): the "auto" budget against a hand computation, the config key's warning, and
the gate through which anything but the step reaches host optimizer state: the optimizer's
``local_tensor`` (checkpoint save and load) calls the partitioner's ``release_device_state``
first, in a real engine's save and load.

GPU (``-m gpu``): resident training against torch AdamW, checkpoints behind resident
steps, a budget that shrinks, and a cap are in tests/test_step_assist.py; here, a resident
chunk that does not fit the GPU: one warning, and the run goes on streaming, equal bit for
bit to a run with ``gpu_budget_bytes: 0``.

On the GPU machine:  python3 -m pytest -q -m gpu tests/test_resident_chunks.py
"""

from __future__ import annotations

import warnings

import pytest
import test_stage12_ratio as r12  # noqa: I001 (tests/ is on sys.path under pytest)
import torch

from zeroio.shard.assist import RESIDENT_FRACTION, RESIDENT_RESERVE_BYTES, resident_budget
from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda
from zeroio.testing.models import tiny_mlp

GiB = 1 << 30


def test_auto_budget_by_hand():
    # a 100 GiB device: 10 GiB held by another process, this one's allocator at 30 GiB now
    # and 40 GiB at its peak: training needs 40, 50 are left, half of them less the reserve
    assert RESIDENT_FRACTION == 0.5 and RESIDENT_RESERVE_BYTES == 2 * GiB
    got = resident_budget(total=100 * GiB, free=60 * GiB, reserved=30 * GiB,
                          peak_reserved=40 * GiB, resident=0)
    assert got == 25 * GiB - 2 * GiB
    # once 10 GiB of chunks are resident (inside reserved and the peak) the budget holds
    assert resident_budget(total=100 * GiB, free=50 * GiB, reserved=40 * GiB,
                           peak_reserved=50 * GiB, resident=10 * GiB) == got
    # a peak 20 GiB higher (a longer batch) takes 10 GiB off it
    assert resident_budget(total=100 * GiB, free=50 * GiB, reserved=40 * GiB,
                           peak_reserved=70 * GiB, resident=10 * GiB) == got - 10 * GiB
    # slots not allocated yet count as training's; nothing left is a budget of 0
    assert resident_budget(total=100 * GiB, free=60 * GiB, reserved=30 * GiB,
                           peak_reserved=40 * GiB, resident=0, pending=4 * GiB) == got - 2 * GiB
    assert resident_budget(total=10 * GiB, free=1 * GiB, reserved=9 * GiB,
                           peak_reserved=9 * GiB, resident=0) == 0


@pytest.mark.parametrize("device, warns", [("cpu", False), ("none", True), ("nvme", True)])
def test_budget_key_warns_only_without_cpu_offload(tmp_path, device, warns):
    import zeroio
    from zeroio.errors import ConfigWarning

    off = {"device": device}
    if device == "nvme":
        off["nvme_path"] = str(tmp_path)
    cfg = {"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": off, "tiering": {"gpu_budget_bytes": 0}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = zeroio.load_config(cfg)
    mine = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert loaded.zero_optimization.tiering.gpu_budget_bytes == 0
    if warns:
        assert len(mine) == 1 and "zero_optimization.tiering.gpu_budget_bytes" in mine[0], mine
    else:
        assert not mine, mine


def _gate_body(stage, tmpdir):
    import zeroio

    calls = []
    cfg = r12._config(stage, 1.0, overlap=False)
    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    real = engine.partitioner.release_device_state

    def counted():
        calls.append(1)
        real()

    engine.optimizer.state_gate = counted
    r12._train(engine, 2, 1, engine.device)
    stepping = len(calls)  # the step itself never goes through the gate
    engine.save_checkpoint(tmpdir, tag="t")
    saved = len(calls)
    engine.load_checkpoint(tmpdir, tag="t")
    out = {"stepping": stepping, "save": saved - stepping, "load": len(calls) - saved,
           "wired": engine.optimizer is not None}
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_reads_state_through_the_gate(tmp_path, stage):
    """The engine's ShardedAdam (offload_optimizer cpu) is built with the partitioner's
    ``release_device_state`` as its gate, and save and load both pass it (on CPU the
    partitioner has no assist: the gate is the wait for the step)."""
    out, = run_ranks(_gate_body, 1, stage, str(tmp_path), timeout=180)
    assert out["stepping"] == 0, out
    assert out["save"] > 0 and out["load"] > 0, out


def _engine_gate_body():
    import zeroio

    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=r12._config(2, 1.0))
    gate = engine.optimizer.state_gate
    out = gate == engine.partitioner.release_device_state
    engine.close()
    return out


def test_engine_wires_the_gate():
    assert run_ranks(_engine_gate_body, 1, timeout=120) == [True]


# ---- GPU -------------------------------------------------------------------------------------

def _oom_body():
    import os

    import zeroio
    from zeroio.shard import assist

    os.environ["ZEROIO_STEP_ASSIST"] = "1"
    os.environ["ZEROIO_CPU_ADAM"] = "compiled"
    os.environ["ZEROIO_STEP_CHUNK_NUMEL"] = "64"
    from zeroio.partition import stage12

    stage12.STEP_CHUNK_NUMEL = 64
    assist.SLOT_NUMEL = 32
    assist.BACKLOG_NUMEL = 1 << 40  # every chunk on the GPU: the same split in both runs
    real = assist._Resident.__init__
    made = []

    def no_room(self, numel, device, *rest):
        if len(made) == 2:  # the GPU fills up after two resident chunks
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        made.append(numel)
        real(self, numel, device, *rest)

    out = {}
    for mode, budget in (("auto", None), ("none", 0)):
        cfg = r12._config(2, 1.0, overlap=True, dtype="bf16")
        cfg["zero_optimization"]["tiering"]["gpu_budget_bytes"] = budget
        assist._Resident.__init__ = no_room
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = zeroio.initialize(model=tiny_mlp(), config=cfg)
            losses = r12._train(engine, 3, 1, engine.device)
        assist._Resident.__init__ = real
        out[mode] = {"losses": losses,
                     "counts": dict(engine.stats()["sources"]["stage12.step_assist"]),
                     "warned": [str(w.message) for w in caught
                                if "gpu_budget_bytes" in str(w.message)],
                     "masters": r12._masters(engine).tolist()}
        engine.close()
    return out


@pytest.mark.gpu
def test_a_resident_chunk_that_does_not_fit_streams():
    need_cuda(1)
    out, = run_ranks(_oom_body, 1, timeout=300)
    auto, none = out["auto"], out["none"]
    assert len(auto["warned"]) == 1, auto["warned"]
    assert auto["counts"]["resident_chunks"] == 2, auto["counts"]
    assert none["counts"]["numel_resident"] == 0 and not none["warned"]
    # the same fused Adam on the same chunks, resident or streamed: bit for bit
    assert auto["losses"] == none["losses"]
    assert auto["masters"] == none["masters"]
