"""Sharded Adam(W) vs torch, DeepSpeed LR schedules and loss scaling against hand computation."""

import math

import pytest
import torch

from zeroio.optim.adam import ShardedAdam
from zeroio.optim.loss_scaler import DynamicLossScaler, LossScaler
from zeroio.optim.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)
from zeroio.partition.base import Segment, ShardGroup


class _Opt:
    def __init__(self, lrs):
        self.param_groups = [{"lr": lr, "betas": (0.9, 0.999)} for lr in lrs]


def _run(sched, steps):
    """lr used by each of ``steps`` optimizer steps (schedule stepped after each, as engines do)."""
    out = []
    for _ in range(steps):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step()
    return out


def test_warmup_lr_log():
    s = WarmupLR(_Opt([0.5]), warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4)
    # t=-1 -> min; t: ln(t+1)/ln(4) of the range
    assert _run(s, 6) == pytest.approx(
        [0.0, 0.0, 0.005, 0.01 * math.log(3) / math.log(4), 0.01, 0.01])


def test_warmup_decay_linear():
    s = WarmupDecayLR(_Opt([0.5]), total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=0.01,
                      warmup_num_steps=4, warmup_type="linear")
    lrs = _run(s, 14)
    # lrs[k] is the lr at t = k - 1
    assert lrs[1:6] == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01])
    assert lrs[8] == pytest.approx(0.01 * 3 / 6)   # t = 7: (10 - 7) / (10 - 4)
    assert lrs[11:] == pytest.approx([0.0, 0.0, 0.0])  # t >= 10 clamps at 0


def test_warmup_cosine():
    s = WarmupCosineLR(_Opt([0.02]), total_num_steps=10, warmup_min_ratio=0.1,
                       warmup_num_steps=4, cos_min_ratio=0.01, warmup_type="linear")
    lrs = _run(s, 22)
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.02 * 0.1)
    assert lrs[3] == pytest.approx(0.02 * (0.1 + 0.5 * 0.9))
    cos = (1 + math.cos(math.pi / 6)) / 2   # t = 4: progress (4 - 4 + 1) / (10 - 4)
    assert lrs[5] == pytest.approx(0.02 * (0.01 + 0.99 * cos))
    assert lrs[10] == pytest.approx(0.02 * 0.01) and lrs[21] == pytest.approx(0.02 * 0.01)


def test_one_cycle_lr_and_momentum():
    opt = _Opt([0.5])
    s = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4,
                 decay_lr_rate=0.5, decay_step_size=2)
    assert opt.param_groups[0]["lr"] == 0.001 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    seen = []
    for _ in range(10):
        s.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
    assert seen[0] == pytest.approx((0.001 + 0.009 * 0.25, 0.9 - 0.1 * 0.25))  # t=0: x = 1/8
    assert seen[3] == pytest.approx((0.01, 0.8))                              # peak at t=3
    assert seen[5][0] == pytest.approx(0.001 + 0.009 * 0.5)                    # way down
    assert seen[7][0] == pytest.approx(0.001)                                  # t=7: cycle end
    assert seen[9][0] == pytest.approx(0.001 / 1.5)   # t=9: decay interval (9-8+1)/2 = 1


def test_lr_range_test():
    s = LRRangeTest(_Opt([0.5]), lr_range_test_min_lr=0.001, lr_range_test_step_size=2)
    assert _run(s, 5) == pytest.approx([0.001, 0.0015, 0.002, 0.0025, 0.003])
    st = LRRangeTest(_Opt([0.5]), lr_range_test_min_lr=0.001, lr_range_test_step_size=2,
                     lr_range_test_staircase=True)
    assert _run(st, 5) == pytest.approx([0.001, 0.001, 0.002, 0.002, 0.003])


def test_schedule_state_round_trips_as_json():
    import json

    a = WarmupDecayLR(_Opt([0.5]), total_num_steps=10, warmup_num_steps=4)
    _run(a, 6)
    b = WarmupDecayLR(_Opt([0.5]), total_num_steps=10, warmup_num_steps=4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert _run(a, 3) == _run(b, 3)


def test_dynamic_loss_scaler_follows_deepspeed_rule():
    s = DynamicLossScaler(scale=16.0, scale_window=2, hysteresis=2, min_scale=4.0)
    s.update(True)           # first overflow spends hysteresis
    assert s.scale == 16.0
    s.update(True)           # hysteresis exhausted: halve
    assert s.scale == 8.0
    s.update(False)          # (2 - 1) % 2 != 0
    assert s.scale == 8.0
    s.update(False)          # (3 - 1) % 2 == 0: double, hysteresis refilled
    assert s.scale == 16.0 and s.cur_hysteresis == 2
    for _ in range(6):
        s.update(True)
    assert s.scale == 4.0    # floor
    static = LossScaler(scale=128.0)
    static.update(True)
    assert static.scale == 128.0


@pytest.mark.parametrize("decoupled", [True, False])
def test_sharded_adam_matches_torch(decoupled):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    flat = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    group = ShardGroup(group_index=0, master=flat, grad=torch.zeros_like(flat), numel=22,
                       segments=(Segment(local_offset=0, global_offset=0, numel=22),))
    hyper = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}]
    ours = ShardedAdam([group], hyper, decoupled=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        group.grad.copy_(torch.cat([g.reshape(-1) for g in grads]) * 4.0)
        ours.step(grad_scale=4.0)  # the divisor folds loss scale and clipping
        ref.step()
    torch.testing.assert_close(group.master, torch.cat([p.detach().reshape(-1) for p in params]),
                               rtol=1e-6, atol=1e-7)
    assert ours.steps_taken(0) == 5


def test_chunked_step_with_callback_matches_whole_step():
    def make():
        torch.manual_seed(3)
        m = torch.randn(23)
        return ShardGroup(group_index=0, master=m, grad=torch.zeros(23), numel=23,
                          segments=(Segment(local_offset=0, global_offset=0, numel=23),))

    hyper = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}]
    a, b = make(), make()
    whole, chunked = ShardedAdam([a], hyper, decoupled=True), ShardedAdam([b], hyper, decoupled=True)
    seen = []
    for i in range(4):
        grad = torch.randn(23)
        a.grad.copy_(grad)
        b.grad.copy_(grad)
        whole.step(2.0)
        chunked.step(2.0, on_updated=lambda gi, lo, n, i=i: seen.append((i, gi, lo, n)),
                     chunk_numel=5)
    torch.testing.assert_close(a.master, b.master, rtol=1e-6, atol=1e-7)
    assert chunked.steps_taken(0) == 4
    assert [s[2:] for s in seen if s[0] == 3] == [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]
