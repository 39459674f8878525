"""AlignedBuffer alignment and BufferPool's hard budget under concurrency."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from zeroio.errors import CapacityError
from zeroio.io import AlignedBuffer, BufferPool


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_aligned_buffer(n):
    b = AlignedBuffer(n)
    assert b.data_ptr() % 4096 == 0 and b.capacity % 4096 == 0 and b.capacity >= max(n, 1)
    assert b.tensor.numel() == n and b.tensor.dtype == torch.uint8
    assert b.pinned == torch.cuda.is_available()
    if n >= 8:
        v = b.view(torch.float32)
        v.fill_(1.5)
        assert v.numel() == n // 4 and b.tensor[:4].tolist() == list(torch.tensor([1.5]).view(torch.uint8))
    with pytest.raises(CapacityError):
        b.view(torch.float64, b.capacity)


def test_pool_budget_never_exceeded_under_concurrency():
    budget = 10 * 4096 * 16
    pool = BufferPool(budget, pin=False)
    lock = threading.Lock()
    live = [0]
    peak = [0]
    errors = []

    def hammer(seed):
        rng = random.Random(seed)
        for _ in range(150):
            n = rng.choice([1, 4096, 5000, 30_000, 100_000, 4096 * 16 * 4])
            buf = pool.acquire(n, timeout=30)
            with lock:
                live[0] += buf.capacity
                peak[0] = max(peak[0], live[0])
                if pool.held_bytes > budget:
                    errors.append(pool.held_bytes)
            if buf.data_ptr() % 4096 or buf.nbytes != n:
                errors.append(("bad buffer", n))
            buf.tensor.fill_(seed % 256)  # the memory is really ours while held
            time.sleep(rng.random() * 1e-4)
            if buf.nbytes and int(buf.tensor[-1]) != seed % 256:
                errors.append(("memory shared between holders", n))
            with lock:
                live[0] -= buf.capacity
            pool.release(buf)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert 0 < peak[0] <= budget
    assert pool.peak_bytes <= budget
    assert pool.used_bytes == 0


def test_pool_waiter_gets_buffer_after_release():
    pool = BufferPool(8192, pin=False)
    a = pool.acquire(8192)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(4096, timeout=10)))
    t.start()
    time.sleep(0.05)
    assert not got  # waits while the budget is taken
    pool.release(a)
    t.join(10)
    assert got and pool.used_bytes == 4096


def test_pool_errors():
    pool = BufferPool(8192, pin=False)
    with pytest.raises(CapacityError, match="exceeds the pool budget of 8192"):
        pool.acquire(8193)
    held = pool.acquire(8192)
    with pytest.raises(CapacityError, match="waited"):
        pool.acquire(1, timeout=0.05)
    pool.release(held)
    with pytest.raises(CapacityError, match="not acquired from this pool"):
        pool.release(AlignedBuffer(10))
