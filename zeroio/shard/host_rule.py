"""The host-gradient 16-bit rule without torch: ``zeroio.estimate`` plans with it, and
``host_grads.host_grad_dtype`` applies it in training (its module doc says the whole rule)."""

from __future__ import annotations

GRAD_PIECE_NUMEL = 1 << 25
"""Elements of a stage 1/2 gradient piece at most: what a bucket's slice is consumed in
([Note: gradient pieces] in partition/stage12.py), and so the size of its staging slots."""
STAGING_SLOTS = 3
"""Pinned fp32 staging buffers of one group's slice each that a later write of a host gradient
goes through ([Note: bounded staging] in partition/landing.py)."""


def host_grad_may_be_16bit(*, stage: int, half: bool, cpu_optimizer: bool,
                           accumulation_steps: int, host_numel: int,
                           device_accumulates: bool = False) -> bool:
    """Whether the host gradient shard can stay in the 16-bit compute dtype (``half``), before
    the kernel choice: a CPU Adam steps a non-empty host shard (``cpu_optimizer``:
    offload_optimizer cpu or nvme, whose swapper steps on the CPU), and nothing accumulates on the
    host (stage 1 always; stages 2 and 3 with one micro step, or with the accumulation on the
    device tier: ``device_accumulates``, decided first, [Note: accumulation on the device tier]
    in tiering/device_accum.py). It then is 16-bit exactly when the one-pass kernel steps it
    (shard/host_grads.py's module doc)."""
    host_accumulates = stage != 1 and accumulation_steps > 1 and not device_accumulates
    return cpu_optimizer and host_numel > 0 and half and not host_accumulates


__all__ = ["GRAD_PIECE_NUMEL", "STAGING_SLOTS", "host_grad_may_be_16bit"]
