"""The default fast paths with ``offload_optimizer.device: cpu`` train exactly like plain
``torch.optim.AdamW``, and the overlapped step is safe to have on by default.

The default config (no zeroio-only key) turns on, on a CUDA device, the step assist and the
overlapped step (``zero_optimization.tiering.step_assist`` / ``overlap_step`` "auto"). Here:

- "auto" resolves on for CUDA and off on the CPU; the environment can say auto;
- 30 steps of ``tiny_mlp`` with clipping that bites (the reference's gradient norm is above
  the clip at every step, checked) at stages 1, 2 and 3 (stage 3 with ``offload_param`` cpu
  too): fp32 losses within 1e-6 relative, parameters within 1e-3 of the distance they moved;
  bf16 within 3e-2. On the CPU the overlap is turned on by the key (auto is off there); with
  ``-m gpu`` the default config itself runs on the GPU against torch AdamW on the GPU;
- a collective of the user's on the training group right after ``step()`` (an all-reduce
  of the loss, a barrier), while the step's worker still all-gathers: before the worker got
  its own group this could pair one rank's all-reduce with another's all-gather;
- an EMA of the weights kept through the engine's API (``engine.module.state_dict()`` or
  ``zeroio.zero.GatheredParameters``) right after each ``step()`` equals the EMA of the
  reference's weights.

On the GPU machine:  python3 -m pytest -q -m gpu tests/test_default_exact.py
"""

from __future__ import annotations

import pytest
import torch

from zeroio.config import load_config
from zeroio.config.zero import overlap_step_enabled
from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda
from zeroio.testing.models import mlp_batch, tiny_mlp

STEPS, LR, WD, CLIP, EMA = 30, 1e-2, 0.1, 0.3, 0.9


def _config(stage, dtype="fp32", overlap=None):
    zero = {"stage": stage, "reduce_bucket_size": 40, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0,
                    offload_param={"device": "cpu", "pin_memory": True})
    if overlap is not None:
        zero["tiering"] = {"overlap_step": overlap}
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _reference(world, device):
    """torch AdamW + clip_grad_norm_ on ``device``: per step the mean loss over ranks and the
    gradient norm before clipping; the EMA of the weights (seeded with step 1's, updated after
    every later step, as the engine side keeps it); the initial and final weights (flat)."""
    model = tiny_mlp().to(device)
    first = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms, ema = [], [], None
    for step in range(STEPS):
        outs = [torch.nn.functional.mse_loss(model(mlp_batch(step, r)[0].to(device)),
                                             mlp_batch(step, r)[1].to(device))
                for r in range(world)]
        (sum(outs) / world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(sum(o.item() for o in outs) / world)
        ema = _ema_update(ema, {n: v.detach().float().cpu().clone()
                                for n, v in model.state_dict().items()})
    last = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"losses": losses, "norms": norms, "ema": ema, "first": first, "last": last}


def _ema_update(ema, now):
    return now if ema is None else {n: ema[n] * EMA + now[n] * (1 - EMA) for n in ema}


def _full_weights(engine):
    """The whole model's weights (flat, ``parameters()`` order), through the engine's API."""
    import zeroio

    params = list(engine.module.parameters())
    with zeroio.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().reshape(-1) for p in params]).cpu()


def _train_body(stage, dtype, overlap, collective, ema_reader):
    """In a rank: ``STEPS`` steps; after each ``step()``, right away (no synchronize): an
    all-reduce of the loss and a barrier on the training group when ``collective``, and an
    EMA update from the weights read by ``ema_reader`` ("state_dict" or "gathered")."""
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(stage, dtype, overlap))
    dev, dt = engine.device, next(engine.module.parameters()).dtype
    part = engine.partitioner
    overlapping = bool(getattr(part, "overlap_forward", False)
                       or getattr(getattr(part, "settings", None), "overlap_step", False))
    losses, ema = [], None
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x.to(dev, dt)).float(), y.to(dev))
        engine.backward(loss)
        engine.step()
        if collective:
            total = loss.detach().float().reshape(1).clone()
            dist.all_reduce(total)
            dist.barrier()
            losses.append(total.item() / world)
        else:
            losses.append(loss.item())
        if ema_reader == "state_dict":
            now = {n: v.detach().float().cpu().clone()
                   for n, v in engine.module.state_dict().items()}
        else:
            params = dict(engine.module.named_parameters())
            with zeroio.zero.GatheredParameters(list(params.values())):
                now = {n: p.detach().float().cpu().clone() for n, p in params.items()}
        ema = _ema_update(ema, now)
    out = {"losses": losses, "weights": _full_weights(engine).tolist(),
           "ema": {n: v.tolist() for n, v in ema.items()}, "overlap": overlapping}
    engine.close()
    return out


def _check(out, ref, tight):
    assert min(ref["norms"]) > CLIP, f"clipping must bite at every step: {min(ref['norms'])}"
    if tight:  # every rank's loss after the mean; bf16 rounds the forward
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    else:
        assert out["losses"] == pytest.approx(ref["losses"], rel=3e-2)
    moved = (ref["last"] - ref["first"]).abs().max().item()
    tol = (1e-3 if tight else 3e-2) * moved
    err = (torch.tensor(out["weights"]) - ref["last"]).abs().max().item()
    assert err <= tol, ("weights", err, tol)
    for n, want in ref["ema"].items():
        err = (torch.tensor(out["ema"][n]) - want).abs().max().item()
        assert err <= tol, ("ema", n, err, tol)


# ---- configuration ---------------------------------------------------------------------------

def test_auto_is_on_for_cuda_only(monkeypatch):
    monkeypatch.delenv("ZEROIO_OVERLAP_STEP", raising=False)
    tiering = load_config(_config(2)).zero_optimization.tiering
    assert tiering.overlap_step is None  # "auto"
    assert overlap_step_enabled(tiering, torch.device("cuda", 0)) is True
    assert overlap_step_enabled(tiering, torch.device("cpu")) is False
    assert overlap_step_enabled(tiering) is False  # device not known yet
    off = load_config(_config(2, overlap=False)).zero_optimization.tiering
    assert overlap_step_enabled(off, torch.device("cuda", 0)) is False
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "auto")
    on = load_config(_config(2, overlap=True)).zero_optimization.tiering
    assert overlap_step_enabled(on, torch.device("cpu")) is False


# ---- CPU: the overlap on by the key ----------------------------------------------------------

@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_overlapped_step_trains_like_torch_adamw(stage, dtype):
    # stage 3's module.state_dict() holds the partitioned (empty) tensors, as DeepSpeed's
    reader = "gathered" if stage == 3 else "state_dict"
    (out,) = run_ranks(_train_body, 1, stage, dtype, True, False, reader)
    assert out["overlap"]
    _check(out, _reference(1, torch.device("cpu")), dtype == "fp32")


@pytest.mark.parametrize("stage, reader", [(2, "state_dict"), (1, "gathered"),
                                           (3, "gathered")])
def test_user_collectives_and_ema_right_after_step(stage, reader):
    """Two ranks (gloo): the user's all-reduce and barrier right after ``step()``, while the
    worker still gathers, neither hang nor change a number; the EMA read through the engine's
    API equals the reference's."""
    outs = run_ranks(_train_body, 2, stage, "fp32", True, True, reader, timeout=240)
    ref = _reference(2, torch.device("cpu"))
    for out in outs:
        assert out["overlap"]
        _check(out, ref, True)


# ---- GPU: the default config itself ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"),
                                          (1, "bf16"), (2, "bf16"), (3, "bf16")])
def test_default_config_trains_like_torch_adamw_on_gpu(stage, dtype):
    need_cuda(1)
    reader = "gathered" if stage == 3 else "state_dict"
    (out,) = run_ranks(_train_body, 1, stage, dtype, None, False, reader, timeout=300)
    assert out["overlap"], "the default config did not overlap the step on CUDA"
    _check(out, _reference(1, torch.device("cuda", 0)), dtype == "fp32")
