"""Loss scaling for fp16: static or DeepSpeed's dynamic scaler (same keys, same rule).

Dynamic rule (DeepSpeed's): on overflow, if hysteresis is exhausted the scale
is divided by 2 (not below ``min_loss_scale``), else one unit of hysteresis is
spent; after ``loss_scale_window`` steps without overflow since the last one
the scale doubles. With ``consecutive_hysteresis`` every clean step refills
the hysteresis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class LossScaler:
    """Constant scale (1.0 for fp32/bf16, ``fp16.loss_scale`` when > 0)."""

    scale: float = 1.0
    dynamic: bool = False

    def update(self, overflow: bool) -> None:
        """Static: nothing changes."""

    def state_dict(self) -> dict:
        return {"cur_scale": self.scale, "dynamic": False}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["cur_scale"])


@dataclass(kw_only=True)
class DynamicLossScaler(LossScaler):
    scale: float = 2.0**16
    dynamic: bool = True
    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    scale_factor: float = 2.0
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2

    def __post_init__(self) -> None:
        self.cur_hysteresis = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.scale, "dynamic": True, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["cur_scale"])
        self.cur_iter = int(sd.get("cur_iter", 0))
        self.last_overflow_iter = int(sd.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(sd.get("cur_hysteresis", self.hysteresis))


def build_loss_scaler(fp16_cfg) -> LossScaler:
    """From ``cfg.fp16`` (DeepSpeed keys); a disabled block gives the unit scaler."""
    if fp16_cfg is None or not fp16_cfg.enabled:
        return LossScaler()
    if fp16_cfg.loss_scale and fp16_cfg.loss_scale > 0:
        return LossScaler(scale=float(fp16_cfg.loss_scale))
    return DynamicLossScaler(
        scale=2.0 ** fp16_cfg.initial_scale_power, scale_window=fp16_cfg.loss_scale_window,
        hysteresis=fp16_cfg.hysteresis, consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
        min_scale=float(fp16_cfg.min_loss_scale))
