"""``deepspeed.ops``' optimizer classes as torch optimizers zeroio's engine runs.

Handed to ``deepspeed.initialize(optimizer=...)`` (or built by accelerate, which maps
torch's Adam, Lion and Adagrad onto ``DeepSpeedCPUAdam`` / ``DeepSpeedCPULion`` /
``DeepSpeedCPUAdagrad`` when the optimizer is offloaded), the engine reads the class's
hyper-parameters and runs its own sharded rule on the partitioned masters: Adam(W) for the
Adam classes (their decoupled-weight-decay flag), and for the others the rule named by the
class attribute ``zeroio_rule`` (zeroio/optim/factory.py, ``from_client``), whose formulas are
DeepSpeed's kernels' (zeroio/optim/rules.py). Outside an engine each class is a working torch
optimizer of its own: ``step()`` applies the same rule to whole parameters (DeepSpeed's run
only on a GPU, or with its compiled CPU ops; these run anywhere).
"""

from __future__ import annotations

import torch

from zeroio.optim.rules import RULES, LambRule


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, amsgrad=False, adamw_mode=True,
                 fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=bool(adamw_mode))


class FusedAdam(torch.optim.Adam):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=bool(adam_w_mode))


class _RuleOptimizer(torch.optim.Optimizer):
    """A torch optimizer stepping zeroio's ``zeroio_rule`` on whole parameters (fp32 state)."""

    zeroio_rule = ""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rule = RULES[self.zeroio_rule]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    for kind in rule.kinds_for([group]):
                        state[kind] = torch.full_like(p, rule.initial(kind, group),
                                                      dtype=torch.float32)
                state["step"] += 1
                self._update(rule, p, state, group)
        return loss

    def _update(self, rule, p, state, group) -> None:
        master = p.detach().float()
        moments = {k: v for k, v in state.items() if k != "step"}
        rule.update(master=master, grad=p.grad.float(), state=moments, hyper=group,
                    step=state["step"])
        p.copy_(master)


class FusedLamb(_RuleOptimizer):
    """DeepSpeed's ``deepspeed.ops.lamb.FusedLamb`` (its signature and defaults); the trust
    ratio is per parameter, clamped to [min_coeff, max_coeff]."""

    zeroio_rule = "lamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0,
                 min_coeff=0.01, amsgrad=False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    def _update(self, rule: LambRule, p, state, group) -> None:
        master = p.detach().float()
        moments = {k: v for k, v in state.items() if k != "step"}
        w_norm = float(master.norm())
        u = rule.moments(master=master, grad=p.grad.float(), state=moments, hyper=group)
        coef = rule.coefficient(w_norm, float(u.norm()), group)
        master.add_(u, alpha=-rule.step_size(group, state["step"]) * coef)
        p.copy_(master)


class FusedLion(_RuleOptimizer):
    """DeepSpeed's ``deepspeed.ops.lion.FusedLion``."""

    zeroio_rule = "lion"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                 set_grad_none=True):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))


class DeepSpeedCPULion(FusedLion):
    """DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion`` (the same rule as ``FusedLion``)."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
                 fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPUAdagrad(_RuleOptimizer):
    """DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` (torch's Adagrad update, no
    learning-rate decay, accumulators starting at 0)."""

    zeroio_rule = "adagrad"

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True):
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdagrad does not support the AMSGrad variant.")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                            lr_decay=0.0, initial_accumulator_value=0.0))
