"""The bytes of the step's small host <-> device reads are counted (zeroio.tiering.copies):
on a GPU, a stage 2 run with ``offload_optimizer.ratio`` 0.5 and Lamb, its counters read
around each routed move and compared with hand computations from the shapes alone.

- the local squared gradient norm: one fp32 scalar from the device (4 bytes);
- Lamb's per-parameter sums: the device side's 2 x parameters float64 sums come to the host
  (16 bytes per parameter); the host side's are there already; the reduction over one gloo
  rank stays on the host;
- the twin's state for checkpoints: the device part of a group read (``local_tensor``,
  ``read_local``) or written (``write_local_range``) crosses at its element size.

On CPU nothing crosses, so nothing is counted (tests/test_stats.py); the handles' counting
itself is checked on CPU tensors in tests/test_tiering_copies.py.

Run on the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_copies_gpu.py
"""

from __future__ import annotations

import pytest

from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda

pytestmark = pytest.mark.gpu

WIDTH = 16


def _delta(after: dict, before: dict) -> dict:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys
            if after.get(k, 0) != before.get(k, 0)}


def _body():
    import torch
    from torch import nn

    import zeroio
    from zeroio.optim.twin import TwinAdam

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2,
                                 "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    opt, stats = engine.optimizer, engine.partitioner.transfers
    assert isinstance(opt, TwinAdam), type(opt)

    def moved():
        return dict(stats.as_dict()["bytes_moved"])

    out = {"device": str(engine.device)}
    x = torch.randn(4, WIDTH, device=engine.device)
    engine.backward(engine(x).pow(2).mean())
    at = moved()
    sq = engine.partitioner.local_grad_sq_norm()
    out["norm"] = _delta(moved(), at)
    out["norm_on"] = str(sq.device)
    at = moved()
    opt._lamb_step(1.0)
    out["lamb"] = _delta(moved(), at)
    out["params"] = opt.device.norms.count
    d, h = opt._split(0), opt._host_numel(0)
    out["split"] = (d, h)
    at = moved()
    whole = opt.local_tensor(0, "exp_avg")
    out["read"] = _delta(moved(), at)
    at = moved()
    part = opt.read_local(0, "exp_avg", 0, d + h)
    out["read_range"] = _delta(moved(), at)
    out["same"] = bool(torch.equal(whole, part))
    at = moved()
    opt.write_local_range(0, "exp_avg", 0, whole.narrow(0, 0, d).clone())
    out["write"] = _delta(moved(), at)
    out["itemsize"] = whole.element_size()
    engine.close()
    return out


def test_the_small_reads_of_a_ratio_lamb_step_are_counted():
    need_cuda(1)
    (r,) = run_ranks(_body, 1, timeout=300)
    assert r["device"].startswith("cuda"), r
    assert r["norm"] == {"gpu->cpu": 4} and r["norm_on"] == "cpu", r
    assert r["lamb"] == {"gpu->cpu": 2 * 8 * r["params"]} and r["params"] == 4, r
    d, h = r["split"]
    assert d > 0 and h > 0, r
    assert r["read"] == r["read_range"] == {"gpu->cpu": d * r["itemsize"]}, r
    assert r["same"], r
    assert r["write"] == {"cpu->gpu": d * r["itemsize"]}, r
