"""``nn.Linear`` under stage 3: autograd keeps the parameter, not a view of its gathered buffer.

[Note: linear layers keep the parameter]
``F.linear`` on CUDA runs as ``addmm``/``mm`` on ``weight.t()`` and autograd saves that
transposed *view* for the backward. A view holds the storage it was made from, so when the
post-forward hook releases the group (``p.data = empty``, the gathered buffer dropped), the
buffer stays allocated until the backward has used the saved view: every layer's gathered
parameters stay on the GPU from its forward to its backward. On the 13B probe (benchmarks/probe_largest.py)
that was the whole 16-bit model, 24 GiB, on top of the activations: the first try ran out of
GPU memory in the forward, and the second peaked 34.7 GiB above its resting memory where the
estimate expected 18 GiB.

``StageThreeLinear`` saves the ``nn.Parameter`` itself. Releasing swaps the parameter's data
for an empty tensor, which frees the buffer; the module's pre-backward hook gathers the group
again before this function's backward unpacks the parameter, so the backward reads the
re-gathered values. ``p.data = ...`` keeps the parameter's version counter, so autograd's
saved-tensor check passes. DeepSpeed's ZeRO-3 does the same (its LinearFunctionForZeroStage3,
swapped in for ``F.linear``); zeroio swaps the class of the plain ``nn.Linear`` modules whose
parameters it manages, so a model that calls ``F.linear`` on a managed parameter itself (or an
``nn.Linear`` subclass) still keeps that buffer until its backward.
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


class StageThreeLinearModule(nn.Linear):
    """An ``nn.Linear`` whose forward runs ``StageThreeLinear``. Stage 3 makes it the class of
    the plain ``nn.Linear`` modules it manages and puts ``nn.Linear`` back when its hooks are
    removed. A class, not a bound method in the instance: ``copy.deepcopy`` and pickling of the
    model keep working, and ``isinstance(m, nn.Linear)`` still holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StageThreeLinear.apply(x, self.weight, self.bias)

    def _get_name(self) -> str:
        return "Linear"  # prints as the module it stands in for


class LinearSwap:
    """Swaps plain ``nn.Linear`` modules to ``StageThreeLinearModule``; ``undo`` swaps back.
    Subclasses of ``nn.Linear`` keep their class (they may rely on it or have their own
    forward)."""

    def __init__(self):
        self._swapped: list[nn.Module] = []

    def apply(self, module: nn.Module) -> None:
        if type(module) is nn.Linear:
            module.__class__ = StageThreeLinearModule
            self._swapped.append(module)

    def undo(self) -> None:
        for module in self._swapped:
            if type(module) is StageThreeLinearModule:
                module.__class__ = nn.Linear
        self._swapped = []
