"""Engine calls out of order (engine_state.[Note: the micro-step protocol]).

DeepSpeed's counting is kept: every ``step()`` counts a micro step and the optimizer steps at
``(micro_steps + 1) % gradient_accumulation_steps == 0``. What DeepSpeed leaves undefined is
refused before anything moves: ``step()`` with no ``backward()`` since the last step, a second
``backward()`` before ``step()``. The reference for "nothing moved" is a plain PyTorch model
and ``torch.optim.AdamW`` fed the same correct calls; for "refused" the engine's own counters
and parameters before and after.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroio
from zeroio.errors import EngineClosedError, EngineStateError, ZeroIOError

LR = 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _config(gas: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 2, **zero}}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 6, generator=g) for _ in range(n)]


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _reference(batches: list[torch.Tensor], gas: int) -> list[torch.Tensor]:
    """Plain PyTorch: mean-over-micro-steps gradients, one AdamW step per ``gas`` batches."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for i, x in enumerate(batches):
        (model(x).pow(2).mean() / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    return _params(model)


def _micro(engine, x) -> None:
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _close_to(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


@pytest.fixture
def engine():
    eng, *_ = zeroio.initialize(model=_model(), config=_config())
    yield eng
    eng.close()


def test_step_without_backward_is_refused_and_moves_nothing(engine):
    before = _params(engine.module)
    with pytest.raises(EngineStateError, match=r"engine\.step\(\) with no engine\.backward\(\)"):
        engine.step()
    assert (engine.global_steps, engine.micro_steps) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine.module), strict=True))
    batches = _batches(3)
    for x in batches:
        _micro(engine, x)
    assert engine.global_steps == 3
    assert _close_to(_params(engine.module), _reference(batches, 1))


def test_a_second_step_is_refused(engine):
    batches = _batches(2)
    _micro(engine, batches[0])
    after_one = _params(engine.module)
    with pytest.raises(EngineStateError, match="no engine.backward"):
        engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(after_one, _params(engine.module), strict=True))
    _micro(engine, batches[1])
    assert _close_to(_params(engine.module), _reference(batches, 1))


def test_two_backwards_at_accumulation_one_are_refused(engine):
    batches = _batches(2)
    engine.backward(engine(batches[0]).pow(2).mean())
    with pytest.raises(EngineStateError, match=r"backward\(\) called twice"):
        engine.backward(engine(batches[1]).pow(2).mean())
    engine.step()  # the first backward's gradients, and only them, are stepped
    _micro(engine, batches[1])
    assert engine.global_steps == 2
    assert _close_to(_params(engine.module), _reference(batches, 1))


def test_accumulation_counts_micro_steps_as_deepspeed_does():
    eng, *_ = zeroio.initialize(model=_model(), config=_config(gas=2))
    try:
        batches = _batches(4)
        seen = []
        for x in batches:
            seen.append(eng.is_gradient_accumulation_boundary())
            _micro(eng, x)
        assert seen == [False, True, False, True]
        assert (eng.global_steps, eng.micro_steps) == (2, 4)
        assert _close_to(_params(eng.module), _reference(batches, 2))
        eng.backward(eng(batches[0]).pow(2).mean())  # mid-accumulation: still one per step
        with pytest.raises(EngineStateError):
            eng.backward(eng(batches[1]).pow(2).mean())
    finally:
        eng.close()


def test_forwards_before_a_backward_are_allowed(engine):
    """An evaluation forward (no_grad) between micro steps is a forward like any other."""
    batches = _batches(2)
    with torch.no_grad():
        engine(batches[1])
        engine(batches[0])
    _micro(engine, batches[0])
    with torch.no_grad():
        engine(batches[0])
    _micro(engine, batches[1])
    assert _close_to(_params(engine.module), _reference(batches, 1))


def test_close_is_idempotent_and_later_calls_are_refused(tmp_path):
    cfg = _config(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    eng, *_ = zeroio.initialize(model=_model(), config=cfg)
    _micro(eng, _batches(1)[0])
    assert [p.name for p in tmp_path.rglob("zeroio-swap-*")]  # the moments' swap folder
    eng.close()
    eng.close()
    assert not list(tmp_path.rglob("zeroio-swap-*"))
    for call in (lambda: eng(_batches(1)[0]), eng.step, lambda: eng.save_checkpoint(tmp_path)):
        with pytest.raises(EngineClosedError, match=r"after engine\.close\(\)"):
            call()
    assert issubclass(EngineClosedError, ZeroIOError) and issubclass(EngineStateError, RuntimeError)


def test_refused_calls_leave_a_trainable_engine_equal_to_an_untouched_one():
    """The same correct calls, with refused ones mixed in, give the same bits."""
    batches = _batches(3)
    a, *_ = zeroio.initialize(model=_model(), config=_config())
    b, *_ = zeroio.initialize(model=copy.deepcopy(_model()), config=_config())
    try:
        for x in batches:
            _micro(a, x)
            with pytest.raises(EngineStateError):
                b.step()
            b.backward(b(x).pow(2).mean())
            with pytest.raises(EngineStateError):
                b.backward(b(x).pow(2).mean())
            b.step()
        assert all(torch.equal(p, q) for p, q in zip(_params(a.module), _params(b.module),
                                                       strict=True))
    finally:
        a.close()
        b.close()
