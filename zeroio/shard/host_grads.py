"""The dtype of the host gradient shard, for every stage: the one rule the partitioners apply
and zeroio.estimate plans with.

A host gradient shard is kept in the 16-bit compute dtype when
- the host side is stepped by a CPU Adam: offload_optimizer cpu (``ShardedAdam``) or nvme
  (``SwappedAdam``, which steps each swapped piece with the same kernel: [Note: the gradient a
  piece reads] in optim/swap.py),
- nothing is accumulated on the host: stage 1 (micro steps are summed in the replicated
  device gradient, the host gets the reduced total once), stages 2 and 3 with
  ``gradient_accumulation_steps`` 1, or above it with the accumulation on the device tier
  (``device_accumulates``: the micro steps are summed in an fp32 buffer on the GPU and the
  boundary micro step casts the total to 16 bits there, one rounding as with one micro step;
  [Note: accumulation on the device tier] in tiering/device_accum.py, whose placement is
  decided first, from the fp32 buffer's size); otherwise the micro steps are summed on the
  host, in fp32,
- and the one-pass CPU Adam steps it (optim/cpu_adam.py, which upcasts the gradient in
  registers: exact), as the ``kernel``'s ``wanted`` decides (its ``planned`` when planning).
float32 otherwise. How each stage makes and uses the 16-bit values: [Note: 16-bit host
gradients] in partition/stage12.py, [Note: 16-bit host gradients at stage 3] in
partition/stage3/grads.py.

The kernel is handed in (the engine passes ``zeroio.optim.cpu_adam``, zeroio.estimate
``zeroio.optim.cpu_adam_plan``): the optimizers sit above this layer, and the partitioners
must not import them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zeroio.shard.host_rule import host_grad_may_be_16bit

_HALF = (torch.bfloat16, torch.float16)


class OnePassKernel(Protocol):
    """What the rule asks of the one-pass CPU Adam (``zeroio.optim.cpu_adam`` is one)."""

    def planned(self, total_numel: int) -> bool:
        """Host state of ``total_numel`` elements is planned for the kernel (compiles nothing)."""

    def wanted(self, total_numel: int, grad_dtype: torch.dtype,
               out_dtype: torch.dtype | None, *, master_dtype: torch.dtype,
               state_dtype: torch.dtype) -> bool:
        """The kernel steps that state, and its variant reading ``grad_dtype`` and writing
        ``out_dtype`` (None: no output) over ``master_dtype`` masters and ``state_dtype``
        moments is built now."""


def host_grad_dtype(*, stage: int, compute_dtype: torch.dtype, cpu_optimizer: bool,
                    accumulation_steps: int, host_numel: int, kernel: OnePassKernel | None,
                    step_out: torch.dtype | None = None, plan_only: bool = False,
                    master_dtype: torch.dtype = torch.float32,
                    state_dtype: torch.dtype = torch.float32,
                    device_accumulates: bool = False) -> torch.dtype:
    """dtype of the host gradient shard of ``host_numel`` elements at ``stage`` (module doc).

    ``cpu_optimizer``: the host side is stepped by a CPU Adam (offload_optimizer cpu or nvme,
    the shard in host memory). ``kernel``: the one-pass CPU Adam (None: there is none, fp32).
    ``step_out``: what the partitioner's host step hands the optimizer's update as ``out``
    under the one-pass kernel (the 16-bit dtype it writes, None for no output: the nvme
    swapper's step);
    ``kernel.wanted`` builds that variant here, also when the gradient stays fp32, so no
    training step compiles. ``plan_only``: decide from ``kernel.planned`` alone, compiling
    nothing (zeroio.estimate). ``master_dtype`` / ``state_dtype``: the optimizer state's
    (bf16 with ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states``), which
    the kernel variant built here steps. ``device_accumulates``: the accumulation buffer is
    placed on the device (module doc)."""
    if not (cpu_optimizer and host_numel > 0) or kernel is None:
        return torch.float32
    grad = compute_dtype if host_grad_may_be_16bit(
        stage=stage, half=compute_dtype in _HALF, cpu_optimizer=cpu_optimizer,
        accumulation_steps=accumulation_steps, host_numel=host_numel,
        device_accumulates=device_accumulates) else torch.float32
    if plan_only:
        one_pass = kernel.planned(host_numel)
    else:
        one_pass = kernel.wanted(host_numel, grad_dtype=grad, out_dtype=step_out,
                                 master_dtype=master_dtype, state_dtype=state_dtype)
    return grad if one_pass else torch.float32


__all__ = ["OnePassKernel", "host_grad_dtype"]
