"""``nn.Linear`` under stage 3: autograd keeps the parameter, not a view of its gathered buffer.

[Note: linear layers keep the parameter]
``F.linear`` on CUDA runs as ``addmm``/``mm`` on ``weight.t()`` and autograd saves that
transposed *view* for the backward. A view holds the storage it was made from, so when the
post-forward hook releases the group (``p.data = empty``, the gathered buffer dropped), the
buffer stays allocated until the backward has used the saved view: every layer's gathered
parameters stay on the GPU from its forward to its backward. On the 13B probe (session 4)
that was the whole 16-bit model, 24 GiB, on top of the activations: the first try ran out of
GPU memory in the forward, and the second peaked 34.7 GiB above its resting memory where the
estimate expected 18 GiB.

``StageThreeLinear`` saves the ``nn.Parameter`` itself. Releasing swaps the parameter's data
for an empty tensor, which frees the buffer; the module's pre-backward hook gathers the group
again before this function's backward unpacks the parameter, so the backward reads the
re-gathered values. ``p.data = ...`` keeps the parameter's version counter, so autograd's
saved-tensor check passes. DeepSpeed's ZeRO-3 does the same (its LinearFunctionForZeroStage3,
swapped in for ``F.linear``); zeroio swaps the forward of the ``nn.Linear`` modules whose
parameters it manages, so a model that calls ``F.linear`` on a managed parameter itself still
keeps that buffer until its backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class StageThreeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        dt = grad_out.dtype  # under autocast the forward ran in the lower precision
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight.to(dt))
        if ctx.needs_input_grad[1]:
            grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1]).to(dt))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return StageThreeLinear.apply(x, module.weight, module.bias)


class LinearSwap:
    """Points the ``forward`` of ``nn.Linear`` modules at ``StageThreeLinear``; ``undo`` puts
    each module back as it was."""

    def __init__(self):
        self._swapped: list[nn.Module] = []

    def apply(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            return  # not a Linear, or a subclass with its own forward: leave it alone
        if "forward" in module.__dict__:
            return  # someone already replaced this instance's forward
        module.forward = _forward.__get__(module)
        self._swapped.append(module)

    def undo(self) -> None:
        for module in self._swapped:
            module.__dict__.pop("forward", None)
        self._swapped = []
