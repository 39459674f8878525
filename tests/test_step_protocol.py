"""The step protocol is chosen once at initialize (zeroio/step_protocol.py, [Note: step
protocols]) and is the one the engine's steps run: checked against the partitioner calls a
step makes, for each placement, and against plain AdamW for the result."""

from __future__ import annotations

import pytest
import torch

import zeroio
from zeroio.step_protocol import OverlappedHostStep, RangePublish, WholePublish


def _config(stage: int, offload: str, nvme_path=None) -> dict:
    zero: dict = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(nvme_path)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": zero}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("stage,offload,protocol", [
    (2, "cpu", OverlappedHostStep), (3, "cpu", OverlappedHostStep),
    (2, "nvme", RangePublish), (3, "nvme", WholePublish),  # stage 3 publishes shards whole
    (2, "none", WholePublish), (3, "none", WholePublish),
])
def test_chosen_once_and_run_by_every_step(tmp_path, monkeypatch, stage, offload, protocol):
    engine, *_ = zeroio.initialize(model=_model(), config=_config(stage, offload, tmp_path))
    try:
        assert isinstance(engine.step_protocol, protocol)
        part = engine.partitioner
        calls: list[str] = []
        for name in ("run_step", "publish_params"):
            real = getattr(part, name)
            monkeypatch.setattr(part, name, lambda *a, _real=real, _n=name, **k:
                                (calls.append(_n), _real(*a, **k))[1])
        reference = _model()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        engine.synchronize()
        want = ["run_step"] if protocol is OverlappedHostStep else ["publish_params"]
        assert calls == want * 3
        with torch.no_grad():
            x = torch.randn(8, 16, generator=gen)
            torch.testing.assert_close(engine(x).float(), reference(x), rtol=1e-4, atol=1e-5)
    finally:
        engine.close()
