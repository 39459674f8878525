"""``deepspeed.ops.adam``: DeepSpeed's Adam classes as torch optimizers zeroio's engine runs.

accelerate replaces a torch optimizer by ``DeepSpeedCPUAdam(param_groups, lr=,
weight_decay=, adamw_mode=)`` when the optimizer is offloaded; the engine reads a
client Adam's groups and its decoupled-weight-decay flag (zeroio/optim/factory.py)
and runs its own sharded Adam, so these classes only carry the hyper-parameters.
"""

from __future__ import annotations

import torch


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
