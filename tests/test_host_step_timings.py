"""engine.stats()["timings"] splits the host optimizer step (offload_optimizer cpu) into the
worker's CPU Adam and publication phases, for stages 2 and 3: the worker thread is invisible
to torch.profiler, so these are what tell a slow step apart. CPU Adam is slowed by a known
amount per chunk here, so the Adam phase must account for at least that much."""

import pytest

from zeroio.testing import run_ranks

DELAY = 0.02


def _body(stage):
    import time

    import torch

    import zeroio
    from zeroio.optim.adam import ChunkedStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    calls = []
    update = ChunkedStep.update

    def slow(self, gi, lo, n, **kw):
        time.sleep(DELAY)
        calls.append(n)
        return update(self, gi, lo, n, **kw)

    ChunkedStep.update = slow
    try:
        for _ in range(3):
            x = torch.randn(4, 8)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    finally:
        ChunkedStep.update = update
    t = engine.stats()["timings"]
    engine.close()
    return t, len(calls)


@pytest.mark.parametrize("stage", [2, 3])
def test_host_step_phases_account_for_cpu_adam(stage):
    (t, n_calls), = run_ranks(_body, 1, stage)
    assert n_calls > 0
    assert t["host_adam_s"] >= n_calls * DELAY * 0.95
    assert t["host_publish_s"] > 0
    # the phases happen inside the step the training thread waits for
    assert t["host_adam_s"] + t["host_publish_s"] <= t["step_s"] + 0.05


def test_step_threads_knob(monkeypatch):
    import torch

    from zeroio.errors import ConfigError
    from zeroio.partition.step_overlap import StepRunner

    seen = []
    monkeypatch.setenv("ZEROIO_STEP_THREADS", "1")
    runner = StepRunner(2, torch.device("cpu"))
    runner.start(lambda i: seen.append(torch.get_num_threads()))
    runner.join()
    assert seen == [1, 1]
    monkeypatch.setenv("ZEROIO_STEP_THREADS", "zero")
    with pytest.raises(ConfigError, match="ZEROIO_STEP_THREADS"):
        StepRunner(1, torch.device("cpu")).start(lambda i: None)


def test_step_threads_default_is_this_ranks_share_of_the_cores(monkeypatch):
    """Unset ZEROIO_STEP_THREADS: the CPUs this process may use (counted by hand from the
    affinity mask) over LOCAL_WORLD_SIZE, whatever torch's own count is (torchrun leaves it
    at 1 in every rank)."""
    import os

    import torch

    from zeroio.partition.step_overlap import StepRunner, cpu_share, step_threads

    usable = len(os.sched_getaffinity(0))
    monkeypatch.delenv("ZEROIO_STEP_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        assert step_threads() == usable
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert step_threads() == max(1, usable // 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(usable * 4))
        assert step_threads() == 1
        assert cpu_share(2) == max(1, usable // 2)  # zeroio train --nproc 2, before launch
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        seen = []
        runner = StepRunner(1, torch.device("cpu"))
        runner.start(lambda i: seen.append(torch.get_num_threads()))
        runner.join()
        assert seen == [usable]
    finally:
        torch.set_num_threads(before)
