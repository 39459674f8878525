"""Stage 3 bounds how far the host runs ahead of the GPU ([Note: bounding the host's run-ahead]
in zeroio/partition/stage3/streams.py).

On the CPU: FreeQueue's order and limit, with stand-in events. On a GPU: a stack of layers
whose forward spins the GPU (``torch.cuda._sleep``) so the host queues the whole pass long
before the GPU reaches its end; the peak memory of a pass is measured with the queue's limit
and without it (the code before the fix), and a training step runs to the end under the lag.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroio
from zeroio.partition.stage3 import streams as st
from zeroio.testing.cuda import need_cuda


class _Event:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(self.name)


def test_free_queue_waits_for_the_oldest_frees_beyond_its_limit(monkeypatch):
    log, made = [], []

    def record(stream):
        if stream is None:
            return None
        made.append(f"{stream}{len(made)}")
        return _Event(log, made[-1])

    monkeypatch.setattr(st, "record", record)
    q = st.FreeQueue(limit=2)
    q.freed("c")            # c0
    q.freed("c", "d")       # c1 d2: one free, two streams
    q.freed(None)           # CPU: nothing pending
    q.throttle()
    assert (log, len(q), q.waits) == ([], 2, 0)
    q.freed("c")            # c3
    q.freed("c")            # c4
    q.throttle()            # 4 pending > 2: the two oldest frees, all their events, in order
    assert log == ["c0", "c1", "d2"]
    assert (len(q), q.waits) == (2, 2)


WIDTH, LAYERS = 2048, 16
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 2  # bf16 weight + bias


class _SlowLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time per layer; the host needs < 1 ms
        return self.lin(x)


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(*[_SlowLinear() for _ in range(LAYERS)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3,
                                 # pinned: asynchronous copies, so nothing syncs the host
                                 "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 2 * WIDTH * (WIDTH + 1),
                                 "stage3_prefetch_bucket_size": WIDTH * (WIDTH + 1),
                                 "stage3_max_reuse_distance": 0}}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    return engine


def _pass_peak(engine, x) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        engine(x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpu_memory_of_a_lagging_pass_is_bounded():
    need_cuda(1)
    engine = _engine()
    frees = engine.partitioner.streams.frees
    x = torch.randn(4, WIDTH, device=engine.device, dtype=torch.bfloat16)
    with torch.no_grad():
        engine(x)  # the first pass records the trace
    limit = frees.limit
    frees.limit = 10 ** 9  # as before the fix: the host never waits
    unbounded = _pass_peak(engine, x)
    frees.limit = limit
    waits = frees.waits
    bounded = _pass_peak(engine, x)
    assert frees.waits > waits, "the host never waited for the GPU: the lag did not build up"
    # live groups (max_live: 2 layers, + the one being gathered), FREE_LAG freed ones and one
    # shard's H2D copy in flight; activations of 4 x 2048 are negligible
    assert bounded <= (3 + st.FREE_LAG + 1) * LAYER_BYTES + (1 << 20), (bounded, unbounded)
    assert unbounded >= 12 * LAYER_BYTES, (
        f"without the limit the pass held {unbounded} bytes: the GPU did not lag, so this "
        "test shows nothing")

    # a whole training step under the lag: no deadlock between the waits and the streams
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
