"""DeepSpeed's learning-rate schedules, same formulas, over any object with ``param_groups``.

All are stepped once per optimizer step (after it, skipped steps excepted, as
DeepSpeed does) and hold only ``last_batch_iteration`` as state, so
``state_dict()`` is JSON. Construction with ``last_batch_iteration == -1``
writes the initial LR into the groups (DeepSpeed's behaviour: the first
step runs at ``warmup_min_lr`` / 0 / ``cycle_min_lr``).

Formulas (t = last_batch_iteration, W = max(2, warmup_num_steps)):
- warmup gamma: log: ln(t + 1) / ln(W); linear: t / W; 1 once t >= W.
- WarmupLR: min + (max - min) * gamma.
- WarmupDecayLR: after warmup gamma = max(0, (T - t) / max(1, T - W)).
- WarmupCosineLR: ratio = min_ratio + gamma * (1 - min_ratio) in warmup, then
  cos_min + (1 - cos_min) * (1 + cos(pi * min(1, (t - W + 1) / max(1, T - W)))) / 2;
  lr = the group's initial lr * ratio.
- OneCycle: triangle from cycle_min_lr to cycle_max_lr over first/second step
  sizes (optionally in stairs), momentum (beta1) cycled inversely; after the
  cycle lr = min / (1 + decay_lr_rate * (t - total + 1) / decay_step_size).
- LRRangeTest: min_lr * (1 + step_rate * (t + 1) / step_size) (floor with staircase).
"""

from __future__ import annotations

import math
from typing import Any

from zeroio.errors import ConfigError


class _Schedule:
    def __init__(self, optimizer: Any, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr or [g["lr"] for g in self.optimizer.param_groups])

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._apply()


def _per_group(optimizer, value, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"scheduler.params.{name}: expected {n} values (one per param "
                              f"group), got {len(value)}", key=f"scheduler.params.{name}")
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_gamma(t: int, warmup: int, kind: str) -> float | None:
    if t < warmup:
        return math.log(t + 1) / math.log(warmup) if kind == "log" else t / warmup
    return None


class WarmupLR(_Schedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def _gamma(self) -> float:
        g = _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0 if g is None else g

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        g = _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        if g is not None:
            return g
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        g = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
        if g is not None:
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cos = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": self.org_lrs}

    def load_state_dict(self, sd: dict) -> None:
        self.org_lrs = [float(v) for v in sd.get("org_lrs", self.org_lrs)]
        super().load_state_dict(sd)


class OneCycle(_Schedule):
    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else int(cycle_second_stair_count))
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr = float(cycle_min_lr), float(cycle_max_lr)
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        self.skip_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = self.skip_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = self.skip_decay or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum)
        self.min_mom, self.max_mom = float(cycle_min_mom), float(cycle_max_mom)
        if last_batch_iteration == -1:
            for g in optimizer.param_groups:
                g["lr"] = self.min_lr
                if self.cycle_momentum:
                    g["betas"] = (self.min_mom, 0.99)

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                where = pos * stairs / self.first_step_size
            else:
                where = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(where) / stairs
        return scale

    def get_lr(self) -> list[float]:
        n = len(self.optimizer.param_groups)
        if self.last_batch_iteration < self.total_size:
            return [self.min_lr + (self.max_lr - self.min_lr) * self._scale()] * n
        if self.skip_lr_decay:
            return [self.min_lr] * n
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [self.min_lr / (1 + self.decay_lr_rate * interval)] * n

    def get_mom(self) -> list[tuple[float, float]]:
        n = len(self.optimizer.param_groups)
        if self.last_batch_iteration < self.total_size:
            return [(self.max_mom - (self.max_mom - self.min_mom) * self._scale(), 0.99)] * n
        if self.skip_mom_decay:
            return [(self.max_mom, 0.99)] * n
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(self.max_mom * (1 + self.decay_mom_rate * interval), 0.99)] * n

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for g, mom in zip(self.optimizer.param_groups, self.get_mom(), strict=True):
                g["betas"] = mom


class LRRangeTest(_Schedule):
    def __init__(self, optimizer, lr_range_test_min_lr=0.001, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = float(lr_range_test_step_size)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            for g, lr in zip(optimizer.param_groups, self.min_lrs, strict=True):
                g["lr"] = lr

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
             "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(scheduler_cfg, optimizer):
    """From ``cfg.scheduler`` (type and completed params) -> a schedule bound to ``optimizer``."""
    if scheduler_cfg is None:
        return None
    cls = SCHEDULES.get(scheduler_cfg.type)
    if cls is None:
        raise ConfigError(f"scheduler.type = {scheduler_cfg.type!r}: expected one of "
                          f"{', '.join(SCHEDULES)}", key="scheduler.type")
    return cls(optimizer, **dict(scheduler_cfg.params))
