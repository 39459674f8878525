"""The update rules zeroio steps beside Adam(W): SGD, Adagrad, Lion and Lamb, on flat fp32 tensors.

Each rule names its per-element state (``kinds``: the arrays a checkpoint stores, e.g.
"momentum_buffer") and updates a run of a master, its gradient (already divided by the step's
``grad_scale``) and that state in place, with torch ops, on whatever device the tensors are.
Adam(W) is not here: it keeps its fused and compiled kernels (adam.py, cpu_adam.py).

[Note: elementwise rules]
SGD, Adagrad and Lion touch each element alone, so updating a group's local range piece by
piece (NVMe pieces, a ratio split between device and host) gives the same numbers as updating
it at once, as for Adam. Lamb does not: its trust ratio is a per-parameter quantity
(``LambRule``, and ``lamb_norms.py`` for the sharded sums).

Each formula follows its reference operation by operation (torch.optim's single-tensor
``sgd`` / ``adagrad``; DeepSpeed's FusedLion and FusedLamb kernels), so a step of the whole
model gives the reference's numbers to float32 rounding.
"""

from __future__ import annotations

import math

import torch


class Rule:
    """One update rule: its name, its state kinds and their initial value."""

    name: str = ""
    kinds: tuple[str, ...] = ()
    elementwise: bool = True
    """[Note: elementwise rules]; False: the step needs per-parameter norms (Lamb)."""

    def kinds_for(self, hyper: list[dict]) -> tuple[str, ...]:
        """The state kinds this run keeps (SGD without momentum keeps none)."""
        return self.kinds

    def initial(self, kind: str, hyper: dict) -> float:
        """The value a ``kind`` state starts at."""
        return 0.0

    def update(self, *, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               hyper: dict, step: int) -> None:
        """Update ``master`` and ``state`` in place (``step``: this update's number, from 1)."""
        raise NotImplementedError


class SGDRule(Rule):
    """torch.optim.SGD: weight decay as L2, momentum with dampening, Nesterov. The momentum
    buffer starts as the first step's gradient (torch's ``buf is None`` case)."""

    name = "sgd"
    kinds = ("momentum_buffer",)

    def kinds_for(self, hyper: list[dict]) -> tuple[str, ...]:
        return self.kinds if any(float(h["momentum"]) != 0.0 for h in hyper) else ()

    def update(self, *, master, grad, state, hyper, step) -> None:
        wd, momentum = float(hyper["weight_decay"]), float(hyper["momentum"])
        if wd != 0.0:
            grad = grad.add(master, alpha=wd)
        if momentum != 0.0:
            buf = state.get("momentum_buffer")
            if buf is None:
                raise ValueError("SGD momentum became nonzero after the optimizer was built "
                                 "without a momentum buffer (optimizer.params.momentum was 0)")
            if step == 1:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - float(hyper["dampening"]))
            grad = grad.add(buf, alpha=momentum) if hyper["nesterov"] else buf
        master.add_(grad, alpha=-float(hyper["lr"]))


class AdagradRule(Rule):
    """torch.optim.Adagrad: L2 weight decay, ``lr / (1 + (step - 1) lr_decay)``, the sum of
    squared gradients starting at ``initial_accumulator_value``."""

    name = "adagrad"
    kinds = ("sum",)

    def initial(self, kind: str, hyper: dict) -> float:
        return float(hyper["initial_accumulator_value"])

    def update(self, *, master, grad, state, hyper, step) -> None:
        wd = float(hyper["weight_decay"])
        if wd != 0.0:
            grad = grad.add(master, alpha=wd)
        clr = float(hyper["lr"]) / (1 + (step - 1) * float(hyper["lr_decay"]))
        acc = state["sum"]
        acc.addcmul_(grad, grad, value=1)
        std = acc.sqrt().add_(float(hyper["eps"]))
        master.addcdiv_(grad, std, value=-clr)


class LionRule(Rule):
    """Lion (DeepSpeed's FusedLion): decoupled weight decay, a step of ``lr`` times the sign of
    ``beta1 m + (1 - beta1) g``, then ``m = beta2 m + (1 - beta2) g``."""

    name = "lion"
    kinds = ("exp_avg",)

    def update(self, *, master, grad, state, hyper, step) -> None:
        lr, wd = float(hyper["lr"]), float(hyper["weight_decay"])
        beta1, beta2 = (float(b) for b in hyper["betas"])
        m = state["exp_avg"]
        master.mul_(1 - lr * wd)
        direction = m.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
        master.add_(direction, alpha=-lr)
        m.mul_(beta2).add_(grad, alpha=1 - beta2)


class LambRule(Rule):
    """DeepSpeed's FusedLamb: Adam moments, the direction ``u = m / (sqrt(v) + eps) + wd w``
    (``eps_inside_sqrt``: ``sqrt(v + eps)``), and per parameter
    ``w -= step_size * clamp(||w|| / ||u||, min_coeff, max_coeff) * u`` (1 where either norm
    is 0), ``step_size = lr sqrt(1 - beta2^t) / (1 - beta1^t)`` with bias correction, else
    ``lr``. ``||w||`` is the norm before the update. Stepped in two calls: ``moments`` (the
    state and ``u``), then ``apply`` with each parameter's coefficient."""

    name = "lamb"
    kinds = ("exp_avg", "exp_avg_sq")
    elementwise = False

    def update(self, *, master, grad, state, hyper, step) -> None:
        raise TypeError("Lamb is stepped with moments() and apply() (per-parameter norms)")

    @staticmethod
    def moments(*, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                hyper: dict) -> torch.Tensor:
        """Update the moments in place; returns the direction ``u`` (a new tensor)."""
        beta1, beta2 = (float(b) for b in hyper["betas"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        eps = float(hyper["eps"])
        denom = v.add(eps).sqrt_() if hyper.get("eps_inside_sqrt") else v.sqrt().add_(eps)
        u = m / denom
        wd = float(hyper["weight_decay"])
        if wd != 0.0:
            u.add_(master, alpha=wd)
        return u

    @staticmethod
    def coefficient(w_norm: float, u_norm: float, hyper: dict) -> float:
        if w_norm == 0.0 or u_norm == 0.0:
            return 1.0
        return min(max(w_norm / u_norm, float(hyper["min_coeff"])), float(hyper["max_coeff"]))

    @staticmethod
    def step_size(hyper: dict, step: int) -> float:
        lr = float(hyper["lr"])
        if not hyper.get("bias_correction", True):
            return lr
        beta1, beta2 = (float(b) for b in hyper["betas"])
        return lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)


RULES: dict[str, Rule] = {r.name: r for r in (SGDRule(), AdagradRule(), LionRule(), LambRule())}
"""The non-Adam rules by ``optimizer.type`` in lower case."""

__all__ = ["RULES", "AdagradRule", "LambRule", "LionRule", "Rule", "SGDRule"]
