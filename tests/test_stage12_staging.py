"""Stage 1/2's later writes of a host gradient go through the bounded staging stage 3 uses
(``StagedAdds``, [Note: bounded staging] in zeroio/partition/landing.py).

On the CPU a gradient lands in host memory on the device it was reduced on, so the add is in
place; the runs here route every later write through the staging instead (``land`` answers as
for a GPU gradient bound for host memory), as on the GPU. Reference: the same run with the
adds in place, bit for bit (the worker adds in the order staged, one at a time: the same
sums). The staging holds at most ``STAGING_SLOTS`` buffers of the largest gradient piece,
whatever the number of buckets or micro-batches; ``zeroio.estimate_memory`` counts it.
"""

from __future__ import annotations

import pytest
import test_stage12_ratio as r12  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.models import tiny_mlp

PIECE = 24
GAS = 3


def _body(staged, dtype):
    import zeroio
    from zeroio.partition import stage12

    stage12.GRAD_PIECE_NUMEL = PIECE
    real = stage12.land
    if staged:
        def land(src, dst, *, first, transfers):  # a later write into host memory: staged
            return False if not first else real(src, dst, first=first, transfers=transfers)
        stage12.land = land
    try:
        engine, *_ = zeroio.initialize(model=tiny_mlp(),
                                       config=r12._config(2, 1.0, gas=GAS, dtype=dtype))
        losses = r12._train(engine, 3, GAS, engine.device)
        part = engine.partitioner
        bufs = part._staged.held_tensors()
        out = {"losses": losses, "masters": r12._masters(engine).tolist(),
               "slots": [b.numel() for b in bufs],
               "pieces": sum(len(ps) for ps in part._pieces),
               "largest": max(p.numel for ps in part._pieces for p in ps),
               "host_grad": sum(g.grad.numel() for g in part.groups),
               "held": sum(t.numel() for t in part.held_tensors() if any(
                   t.data_ptr() == b.data_ptr() for b in bufs))}
        engine.close()
    finally:
        stage12.land = real
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_staged_accumulation_is_bit_equal_and_bounded(world, dtype):
    ref = run_ranks(_body, world, False, dtype, timeout=180)
    got = run_ranks(_body, world, True, dtype, timeout=180)
    for r, g in zip(ref, got, strict=True):
        assert g["losses"] == r["losses"] and g["masters"] == r["masters"]
        assert r["slots"] == []  # in place: nothing staged
        # every later write of 3 steps x 2 micro-batches x every piece went through 3 slots
        assert g["pieces"] > 3 and g["slots"] == [g["largest"]] * 3, g
        assert g["largest"] <= PIECE and g["held"] == 3 * g["largest"] < g["host_grad"]


def test_estimate_counts_stage2_staging():
    from zeroio import load_config
    from zeroio.estimate import estimate_memory
    from zeroio.shard.host_rule import GRAD_PIECE_NUMEL, STAGING_SLOTS

    def items(gas, psi=1_000_000_000, stage=2):
        cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                           "gradient_accumulation_steps": gas, "bf16": {"enabled": True},
                           "zero_optimization": {"stage": stage,
                                                 "offload_optimizer": {"device": "cpu"}}})
        r = estimate_memory(psi, config=cfg)
        return {i.name: i.bytes_per_gpu for i in r.items if i.tier == "cpu"}, r

    name = "gradient accumulation staging (pinned fp32)"
    one, r1 = items(1)
    four, r4 = items(4)
    assert STAGING_SLOTS == 3 and GRAD_PIECE_NUMEL == 1 << 25
    assert name not in one and four[name] == 4 * 3 * (1 << 25)  # 384 MiB, not 4 GB of fp32
    assert items(4, psi=1000)[0][name] == 4 * 3 * 1000  # no more than the offloaded elements
    assert name not in items(4, stage=1)[0]  # stage 1 reduces once, at the boundary
